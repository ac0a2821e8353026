"""Tuned choices: per problem signature and token bucket, in memory and in JSON files.

A file is keyed by GPU name and SM count, CUDA version and library version; a file with
another key is ignored (with a warning). The tables shipped in moe_kernels/tuned/ seed each
device's choices. `lookup` is what tactic resolution asks; inside `moe_kernels.autotune()` it
tunes a bucket the first time it is seen (never during a CUDA graph capture), through the
tuner that autotune() installs, so this module needs nothing from the tuner.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings

from . import _native
from .modes import Activation, QuantMode

# Token buckets: powers of two. A forward of T tokens uses the smallest bucket >= T (the
# largest for more tokens), tuned at the bucket's T, so a pick runs only forwards of more than
# half its T (coarser steps left picks far from their T: docs/design.md, "Tactics"). A bucket
# without a record (a table made before 512/2048/8192 existed) takes the default rule.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CACHE_FORMAT = 2  # records name their tactic as str(Tactic)

def bucket_for(num_tokens: int) -> int:
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens: got {num_tokens!r}, expected a positive int")
    return next((b for b in BUCKETS if b >= num_tokens), BUCKETS[-1])


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
    """What a tuned choice depends on besides the token count (E is the local expert count)."""

    quant: str
    activation: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    out_dtype: str = ""  # hidden states and out of a mode that takes several, when not its first

    def __post_init__(self):
        hidden = QuantMode.parse(self.quant).spec.hidden
        if self.out_dtype and (self.out_dtype not in hidden[1:]):
            raise ValueError(f"out_dtype: got {self.out_dtype!r}, expected '' or one of {list(hidden[1:])} "
                             f"for quant={self.quant!r}")

    @property
    def out(self) -> str:
        """The hidden states' and output's dtype name."""
        return self.out_dtype or QuantMode.parse(self.quant).spec.hidden[0]

    @property
    def hidden_dtype(self):
        """The torch dtype of hidden_states and out."""
        import torch
        return {"bf16": torch.bfloat16, "fp16": torch.float16}[self.out]

    @property
    def signature(self) -> str:
        return (f"{self.quant}/{self.activation}/E{self.experts}/k{self.top_k}/"
                f"H{self.hidden}/I{self.inter}" + (f"/{self.out_dtype}" if self.out_dtype else ""))

    @classmethod
    def parse(cls, signature: str) -> "ProblemSpec":
        try:
            quant, act, e, k, h, i, *out = signature.split("/")
            if len(out) > 1:
                raise ValueError
            return cls(QuantMode.parse(quant).value, Activation.parse(act).value, int(e[1:]),
                       int(k[1:]), int(h[1:]), int(i[1:]), *out)
        except (ValueError, IndexError):
            raise ValueError(f"problem signature {signature!r}: expected "
                             "quant/activation/E<n>/k<n>/H<n>/I<n>[/fp16]") from None


def cache_key(device: int) -> dict:
    from . import __version__
    info = _native.device_info(device)
    lib = _native.library_for(device)
    return {"gpu": info["name"], "sm_count": info["sm_count"],
            "cuda": lib["cuda_version"], "version": __version__}


class TuningCache:
    """Tuned tactics per problem signature and token bucket, for one GPU/CUDA/library key."""

    def __init__(self, key: dict, path: str | None = None):
        self.key = key
        self.path = path
        self.entries: dict = {}
        if path and os.path.exists(path):
            self.merge_file(path)

    def merge_file(self, path: str) -> bool:
        """Add a file's entries if its key matches ours; warn and ignore it otherwise."""
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            warnings.warn(f"moe_kernels: ignoring tuning cache {path}: {e}")
            return False
        if data.get("format") != CACHE_FORMAT or data.get("key") != self.key:
            warnings.warn(f"moe_kernels: ignoring tuning cache {path}: it was made for "
                          f"{data.get('key')} (format {data.get('format')}), this process is "
                          f"{self.key} (format {CACHE_FORMAT})")
            return False
        for sig, buckets in data.get("entries", {}).items():
            self.entries.setdefault(sig, {}).update(buckets)
        _changed()
        return True

    def get(self, spec: ProblemSpec, bucket: int):
        """The bucket's tactic as str(Tactic) prints it, or None."""
        rec = self.entries.get(spec.signature, {}).get(str(bucket))
        return rec["tactic"] if rec else None

    def put(self, spec: ProblemSpec, bucket: int, record: dict) -> None:
        self.entries.setdefault(spec.signature, {})[str(bucket)] = record
        _changed()

    def save(self, path: str | None = None) -> None:
        path = path or self.path
        if not path:
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"format": CACHE_FORMAT, "key": self.key, "entries": self.entries}, f, indent=1)
        os.replace(tmp, path)


# Bumped whenever a table gains records: forwards cache their tactic per signature (moe_kernels.ops)
# and resolve again after a change.
generation = 0


def _changed() -> None:
    global generation
    generation += 1


_caches: dict = {}       # device -> TuningCache holding every choice this process knows
# tuners[-1](spec, bucket, device) -> record or None: the innermost moe_kernels.autotune()'s
tuners: list = []


def cache_for(device: int) -> TuningCache:
    """The in-memory cache of a device, seeded once with the shipped tables that match it."""
    if device not in _caches:
        cache = TuningCache(cache_key(device))
        tuned_dir = os.path.join(os.path.dirname(__file__), "tuned")
        if os.path.isdir(tuned_dir):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # tables for other GPUs are expected not to match
                for name in sorted(os.listdir(tuned_dir)):
                    if name.endswith(".json"):
                        cache.merge_file(os.path.join(tuned_dir, name))
        _caches[device] = cache
    return _caches[device]


def lookup(spec: ProblemSpec, num_tokens: int, device: int):
    """The tuned tactic (as str(Tactic) prints it) for this problem's token bucket, tuning it
    first inside autotune() (never during a CUDA graph capture); None when nothing is known."""
    import torch
    cache = cache_for(device)
    bucket = bucket_for(num_tokens)
    tactic = cache.get(spec, bucket)
    if tactic is not None or not tuners or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return tactic
    rec = tuners[-1](spec, bucket, device)
    if rec is None:
        return None
    cache.put(spec, bucket, rec)
    return cache.get(spec, bucket)
