"""`governor bench`: a streaming benchmark client for a running governor (issue 4, in progress).

`stats` turns per-request client timestamps into the reported figures; `schedule` decides when
each request is submitted. Both are pure, so they are unit-tested without sockets.
"""
