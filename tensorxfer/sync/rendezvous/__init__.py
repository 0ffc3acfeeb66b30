"""Where the ranks of a weight sync find each other: a small key-value interface over a store clusters run.

:class:`Rendezvous` is all the sync layer asks of a store; :class:`TorchStoreRendezvous` implements it on
any ``torch.distributed.Store`` (a ``TCPStore`` hosted by source rank 0 by default).  The planner and the
execution never see the store.
"""

from tensorxfer.sync.rendezvous.base import Rendezvous
from tensorxfer.sync.rendezvous.torchstore import TorchStoreRendezvous, open_tcp_store

__all__ = ["Rendezvous", "TorchStoreRendezvous", "open_tcp_store"]
