"""Every request of every front end as one session (`sessions.Sessions`, the entry point):
plain ones run for their client; kept ones (background responses, resumable streams) outlive
their client connection and their gateway. What every gateway can read about a kept request
is in `store`; the runs this gateway holds are in `runs`; where a client stands in a
request's output is one numbering (`positions`)."""
