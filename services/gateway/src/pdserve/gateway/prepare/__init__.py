"""What a client asks for, in the gateway's own terms: the params both front ends build, their
one validator, tokenization, and the worker pools that keep heavy preparation off the event
loop."""
