"""The pure decision core: no NATS, HTTP, clock or randomness inside.

Everything here takes a snapshot, a request and (where time matters) `now`,
and returns a decision. A test enforces that nothing in this package imports
an I/O library.
"""
