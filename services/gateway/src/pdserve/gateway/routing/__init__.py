"""Where a request goes and when: the router (cache- and load-aware pairs), its prefix policy
and memory, and the admission queue that holds requests until a pair has room."""
