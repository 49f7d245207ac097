"""The public gRPC edge: GenerationService, the parsing of its requests and the conversion of
its messages."""
