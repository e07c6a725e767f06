"""Appointments: a retry hint that binds. The refused client is told when a slot will be free for
it, and that slot is kept for it when it comes.

Each capacity limit that refuses with a forecast hint (the global in-flight cap, the token budget,
the endpoint caps, a tenant's own caps) has a book; so has each rate cap, which pays for its
promises at once. A refusal books the next release nobody was promised yet, if it comes within the
promise horizon (else the refusal is final and books nothing), and tells the client that time,
less what holders are late on average ("be here by"). Around its time, in a window `grace` wide
(`--appointment-grace-ms`), the appointment holds what it was promised: the limit counts it as
taken, so a frame without that appointment is refused while the window lasts, and the client who
holds it is admitted when it comes. If it does not come, the window closes, the appointment
lapses and the capacity is anyone's: a no-show idles a slot at most `grace`. A holder that comes
inside its window but finds the capacity still taken (the forecast was early) waits in the lobby
until it frees or its promise horizon is reached, when it is refused for good. Holds never let
anyone past a cap: they only decide who gets what the cap allows. When most appointments of a
book and rank lapse unkept (a flood that never comes back), those stop keeping capacity until
clients come back for theirs again (per book and rank, so one class's or one tenant's no-shows
unbind no one else's). Sans-IO, with the clock passed in.

    appointment.py   one appointment and its phases: every transition (BOOKED, HELD, LAST_CALL,
                     REDEEMED, LAPSED, GIVEN_BACK) is a method there
    books.py         the books (capacity, prepaid) and how each refuses: one `refuse`, two promises
    registry.py      tickets, identities, the lapsed, outcome counts, what the holders teach
    lobby.py         the returning clients held for their capacity, decided again as it frees

May import: govwire, the rest of admission/ (the lobby re-asks `Admission.decide`), latency.py
and timers.py. The doors reach appointments only through admission's decisions and the lobby.
"""
