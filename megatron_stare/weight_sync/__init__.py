"""Weight transport, one package for the whole project: the bucket format (``bucket``: flat
buffer + JSON header, packing, staging buffers), the wire protocol (``wire``: one bucket =
sizes, header, data over a link), transports (``transport``: in-process, process-group
broadcast), checksums (``checksum``), and the weight groups engines form with the trainer
(``groups``). Used by the Megatron export, the HF checkpoint export and every rollout engine;
everything outside imports the names below, nothing private."""

from megatron_stare.weight_sync.bucket import (ALIGN_BYTES, HEADER_VERSION, Assembler, FlatBucket, StagingBuffer,
                                               TensorMeta, decode_header, assemble, dtype_from_name, dtype_name,
                                               encode_header, iter_buckets, iter_flat_buckets, pack_stream)
from megatron_stare.weight_sync.checksum import TensorChecksum, compare_checksums, tensor_checksum, update_verified
from megatron_stare.weight_sync.groups import PeerCalls, form_group, free_port, init_named_weight_group, push_to_group, route_address
from megatron_stare.weight_sync.transport import (InProcessTransport, PeakMemory, ProcessGroupReceiver,
                                                  ProcessGroupSender, SyncStats)
from megatron_stare.weight_sync.wire import (Pending, group_link, group_link_async, isend_link, recv_bucket, recv_link,
                                             send_bucket, send_bucket_async, send_each, send_end, send_link)

__all__ = ["ALIGN_BYTES", "HEADER_VERSION", "Assembler", "FlatBucket", "InProcessTransport", "PeakMemory", "PeerCalls", "Pending",
           "ProcessGroupReceiver", "ProcessGroupSender", "StagingBuffer", "SyncStats", "TensorChecksum",
           "TensorMeta", "assemble", "compare_checksums", "decode_header", "dtype_from_name", "dtype_name",
           "encode_header", "form_group", "free_port", "group_link", "group_link_async", "init_named_weight_group", "isend_link",
           "iter_buckets", "iter_flat_buckets", "pack_stream", "push_to_group", "recv_bucket", "recv_link",
           "route_address", "send_bucket", "send_bucket_async", "send_each", "send_end", "send_link", "tensor_checksum",
           "update_verified"]
