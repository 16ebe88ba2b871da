"""Host-proxy transport for ranks on other machines: one-sided put + signal.

Interface (one object per rank, created collectively over a process group)::

    t = open_transport(group, region, remote_ranks, *, kind="auto", timeout_s=120.0,
                       secret=None, bind_addr=None, channels=None, channel_groups=None,
                       depth=1024)
    t.put(dst_rank, dst_offset, src)          # queue: write src's bytes at dst_offset
    t.signal(dst_rank, word_offset_bytes, v)  # queue: store int64 v, after earlier puts
    failed = t.flush(dst_rank=None, raise_on_timeout=True)   # a rank, a list or all
    t.lost_ranks()                            # {rank: why} of peers whose link failed
    t.close()

Arguments of :func:`open_transport`:

- ``group``: torch.distributed process group (``None`` = default); every rank calls it.
- ``region``: this rank's registered memory, a 1-D contiguous writeable numpy uint8 array
  starting 8-byte aligned (the host backend passes its segment). Peers can write only here.
- ``remote_ranks``: group ranks this rank exchanges with; must be symmetric (a lists b iff
  b lists a), checked on every rank.
- ``kind``: ``"tcp"``, ``"verbs"``, ``"nixl"`` or ``"auto"`` (then ``MOE_COMM_TRANSPORT``,
  then NIXL if every rank has it and an RDMA device, then verbs if every rank has an RDMA
  device, else TCP); see ``select.py``.
- ``timeout_s``: bounds every blocking step: connecting, a send making no progress, waiting
  for a ring credit, ``flush``. A lapse raises :class:`moe_comm.errors.CommTimeoutError`
  naming the ranks concerned.
- ``secret``: the job secret authenticating TCP connections and NIXL notices (>= 16 bytes,
  same on every rank); ``None`` = rank 0 draws one and shares it over ``group``.
- ``bind_addr``: TCP listen address; default: ``MOE_COMM_BIND_ADDR``, the address of
  ``GLOO_SOCKET_IFNAME``, or the route to the store's host (``addr.py``). Never 0.0.0.0
  unless passed.
- ``channels``: proxy threads (each with its own ring); ``depth``: ring slots per channel.
- ``channel_groups``: lists of remote ranks, one channel each, instead of ``channels`` (the
  backends pass one group per remote host: a slow host holds up only its own channel).

Semantics:

- ``put(dst_rank, dst_offset, src)``: ``src`` is a contiguous CPU numpy array or torch tensor
  (any dtype, sent as its bytes). Returns once queued; ``src`` must stay unchanged until a
  later ``flush`` covering ``dst_rank`` returns (the transport holds a reference, so it is
  not freed). ``dst_offset + nbytes`` must fit the destination's region (``ValueError``).
- ``signal(dst_rank, word_offset_bytes, value)``: the receiver stores ``value`` into the
  aligned int64 word at ``word_offset_bytes`` of its region with a release fence, after it
  applied every earlier put and signal from this rank to it. A reader in any process that
  maps the region polls the word and reads the payload after an acquire fence
  (``moe_comm.shm.atomics.wait_words``): the signal is never seen before the data.
- ``flush``: waits until the commands queued before it were handed to the wire (TCP: in the
  kernel; verbs, NIXL: completed), so their sources may be reused. Ranks that did not get there
  (lost, or still pending at the deadline) raise ``CommTimeoutError``, or are returned when
  ``raise_on_timeout=False``.
- A peer that dies is not an exception at put/signal time: its commands are dropped and
  logged, the receivers' deadline-bounded waits name it, ``flush`` reports it.
- ``close``: flushes (bounded), stops the daemon threads and joins them with a timeout,
  closes sockets / verbs resources. Call after a barrier so no peer still sends.

Security (TCP): listeners bind one address; a connection must pass a mutual HMAC-SHA256
challenge with the job secret before anything else is read (``auth.py``); every write and
signal is bounds-checked against the region before it is applied, and a bad frame drops the
connection (``receiver.py``). Refusals are logged on ``moe_comm.transport``. Verbs: queue
pairs connect only to the QP numbers exchanged over the group; the NIC enforces the memory
region's bounds; signal words are bounds-checked by the receiver. NIXL: agents learn each
other only from the group's exchange; NIXL refuses a write outside the target's registered
memory before sending it; signals travel as notices MAC'd with the job secret per ordered
pair and numbered, so a foreign, forged or replayed notice is refused (``notices.py``), and
the receiver bounds-checks every word.

Modules: ``commands`` (command and frame format), ``ring`` (command ring with credits),
``proxy`` (producer API and proxy threads), ``tcp`` / ``receiver`` / ``auth`` / ``addr``
(TCP engine), ``verbs`` / ``qp`` (RDMA engine, queue-pair state machine), ``nixl`` /
``notices`` (NIXL engine, authenticated signal notices), ``staging`` (registered staging
memory of the verbs and NIXL engines), ``select`` (engine choice, exchange, connection).
"""
from .proxy import ProxyTransport
from .select import ENV, KINDS, open_transport, requested_kind

__all__ = ["open_transport", "ProxyTransport", "requested_kind", "KINDS", "ENV"]
