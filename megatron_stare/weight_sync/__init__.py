"""Weight resharding to rollout engines: bucket plan + checksums (``plan``), transports that move
the buckets (``transport``: in-process, process-group broadcast)."""

from .plan import (FlatBucket, TensorChecksum, TensorMeta, compare_checksums, iter_buckets,
                   iter_flat_buckets, tensor_checksum)
from .transport import (InProcessTransport, PeakMemory, ProcessGroupReceiver, ProcessGroupSender,
                        SyncStats)

__all__ = ["FlatBucket", "InProcessTransport", "PeakMemory", "ProcessGroupReceiver",
           "ProcessGroupSender", "SyncStats", "TensorChecksum", "TensorMeta", "compare_checksums",
           "iter_buckets", "iter_flat_buckets", "tensor_checksum"]
