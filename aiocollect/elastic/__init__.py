"""Elastic groups: survivors regroup and go on, new processes join, nobody restarts.

A generation is an ordinary group formed by an ordinary rendezvous; ``regroup()`` ends the
current one and forms the next under its own name on the store
(``<name>/gen/<k>/a<attempt>``: its own claims, job nonce and handshake name, so a late
frame or record of generation k can never reach generation k+1). Membership is agreed
through the store, under ``E = aiocollect/<name>/elastic``::

    E/g<k>/owner/<r>          who is rank r of generation k (pid and host: liveness)
    E/g<k>/a<a>/member/<id>   participant <id> (``m<old rank>`` or ``j<ticket>``) called in
    E/g<k>/a<a>/decided       counter: the first proposer writes the decision
    E/g<k>/a<a>/decision      the participants of attempt a, in new-rank order
    E/tickets                 counter: join tickets taken
    E/ticket/<t>              who holds ticket t
    E/admit/<t>               (k, a): the attempt that admits ticket t
    E/served                  tickets below this have been admitted or skipped

Rules: a caller of ``regroup()`` registers first, then aborts its old generation (the
peers' in-flight handles fail with GroupBrokenError and they see an ABORT, not a death).
Each participant waits until every candidate has registered or is known dead (the old
generation's PeerDisconnected names it, or its pid is gone on this host), or the timeout
passes; then it proposes the registered ones (old-rank order) plus the live waiting
joiners (ticket order); the first proposal written wins and every participant follows it.
If forming that generation fails (a participant died meanwhile), the same participants
try again as attempt a+1; the generation number stays k.

The package's two modules: :mod:`aiocollect.elastic.generations` (the settings a member
keeps across generations, ``regroup()``, ``join_group``'s work, forming a generation) and
:mod:`aiocollect.elastic.agreement` (the agreement through the store on who forms it).
"""
