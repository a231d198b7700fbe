"""Reading and writing HF safetensors checkpoints tensor by tensor.

``HFCheckpointReader`` opens ``model.safetensors`` or a sharded ``model.safetensors.index.json``
lazily: names and shapes come from the headers, and a tensor's bytes are read only when
``get(name)`` asks for it, so a pipeline stage reads only its own layers.
``HFShardWriter`` writes buckets of ``(name, tensor)`` pairs as numbered safetensors shards and,
on ``finish()``, renames them to HF's ``model-0000i-of-0000N.safetensors`` scheme with an index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Sequence, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: HF tensors that carry no weights (old Llama checkpoints store rope buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFCheckpointReader:
    """Lazy access to the tensors of an HF safetensors checkpoint directory."""

    def __init__(self, hf_dir: Union[str, Path]) -> None:

        self.dir = Path(hf_dir)
        if (self.dir / INDEX).is_file():
            weight_map = json.loads((self.dir / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE).is_file():
            files, weight_map = [SINGLE], None
        else:
            raise ValueError(f"no {SINGLE} or {INDEX} in {self.dir}; point at an HF checkpoint "
                             f"directory saved with safetensors")
        self._handles = {}
        self._where: Dict[str, str] = {}
        for f in files:
            if not (self.dir / f).is_file():
                raise ValueError(f"{self.dir / f} is listed in {INDEX} but missing")
            h = safe_open(str(self.dir / f), framework="pt")
            self._handles[f] = h
            for name in h.keys():
                self._where[name] = f
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise ValueError(f"{INDEX} in {self.dir} lists tensors no shard holds: {missing[:5]}")

    def names(self) -> List[str]:
        return sorted(self._where)

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._handles[self._file(name)].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (read from disk now)."""
        return self._handles[self._file(name)].get_tensor(name)

    def _file(self, name: str) -> str:
        if name not in self._where:
            raise ValueError(f"tensor {name!r} not found in the HF checkpoint {self.dir}")
        return self._where[name]


def check_hf_tensors(names_shapes: Dict[str, Tuple[int, ...]], expected: Dict[str, Tuple[int, ...]],
                     where: str) -> None:
    """Raise one ValueError naming missing, unexpected or mis-shaped HF tensors."""
    present = {n: s for n, s in names_shapes.items() if not n.endswith(IGNORED_SUFFIXES)}
    missing = sorted(set(expected) - set(present))
    # A tied checkpoint may still store lm_head.weight; it is never read.
    extra = sorted(set(present) - set(expected) - {"lm_head.weight"})
    wrong = [f"{n}: expected {expected[n]}, got {present[n]}" for n in sorted(expected)
             if n in present and tuple(present[n]) != tuple(expected[n])]
    msgs = []
    if missing:
        msgs.append(f"{len(missing)} missing tensor(s) e.g. {missing[:3]}")
    if extra:
        msgs.append(f"{len(extra)} unexpected tensor(s) e.g. {extra[:3]}")
    if wrong:
        msgs.append(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:3])}")
    if msgs:
        raise ValueError(f"HF checkpoint {where} does not match its config.json: {'; '.join(msgs)}")


class HFShardWriter:
    """Write buckets of HF tensors as safetensors shards plus ``model.safetensors.index.json``.

    Each ``write(bucket)`` is one shard (so the shard size is the exporter's bucket size);
    tensors are copied out of the bucket first because bucket tensors may be views into one
    flat buffer, which safetensors refuses to serialise as separate tensors.
    """

    def __init__(self, out_dir: Union[str, Path]) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._shards: List[Tuple[str, List[str]]] = []
        self.total_bytes = 0

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def write(self, bucket: Sequence[Tuple[str, torch.Tensor]]) -> Path:

        tensors = {n: t.detach().to("cpu").clone().contiguous() for n, t in bucket}
        tmp = f"shard-{len(self._shards):05d}.safetensors.tmp"
        save_file(tensors, str(self.dir / tmp), metadata={"format": "pt"})
        os.chmod(self.dir / tmp, 0o644)  # safetensors creates 0600 files; HF shards are shared
        self._shards.append((tmp, list(tensors)))
        self.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        return self.dir / tmp

    def finish(self) -> List[Path]:
        """Rename shards to their final HF names and write the index; returns the shard paths."""
        n = len(self._shards)
        if n == 0:
            raise ValueError("no tensors were written")
        if n == 1:
            os.replace(self.dir / self._shards[0][0], self.dir / SINGLE)
            return [self.dir / SINGLE]
        weight_map, paths = {}, []
        for i, (tmp, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / tmp, self.dir / final)
            weight_map.update({name: final for name in names})
            paths.append(self.dir / final)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2))
        return paths
