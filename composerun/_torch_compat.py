"""Every use of torch's private distributed APIs, in one place.

These helpers have moved and changed meaning between torch releases (PITFALLS §6.2), so
composerun reaches them only through this module: a torch upgrade breaks here, once,
with one clear message, and tests/test_registry.py pins the behaviour relied on.  So do
the checkpoint files' undocumented parts composerun relies on (DCP's writer's file system,
its per-item storage records, torch.save's zip layout and CRC-32 switch, what DCP pickles
into `.metadata`): the section at the end, pinned by tests/test_compat.py.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pickle
import struct
import sys
import threading
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, NamedTuple

import torch
import torch.nn as nn

TESTED = ((2, 13), (2, 14))  # [lower, upper) of torch versions this module was checked against


class ComposerunTorchCompatError(ImportError):
    pass


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _require(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ComposerunTorchCompatError(
            f"composerun needs {module}.{name}, which torch {torch.__version__} lacks "
            f"(tested with torch {TESTED[0][0]}.{TESTED[0][1]}): {e}"
        ) from None


if not (TESTED[0] <= _version() < TESTED[1]):
    warnings.warn(
        f"composerun was tested with torch {TESTED[0][0]}.{TESTED[0][1]}; found {torch.__version__}",
        stacklevel=2,
    )

_get_module_state = _require("torch.distributed._composable_state", "_get_module_state")
_get_registry = _require("torch.distributed._composable.contract", "_get_registry")

# FSDP2-family replicate (DTensor params, MixedPrecisionPolicy, 1-D mesh); the older
# DDP-based torch.distributed._composable.replicate is not used (PITFALLS §4.2).
replicate = _require("torch.distributed._composable.replicate_with_fsdp", "replicate")
# Composable activation checkpointing keeps FQNs, unlike checkpoint_wrapper.
checkpoint = _require("torch.distributed._composable.checkpoint_activation", "checkpoint")
# Sees every op a forward on meta tensors runs (the launcher's check of the model and data).
TorchDispatchMode = _require("torch.utils._python_dispatch", "TorchDispatchMode")
# Each tensor's norm in one kernel, as torch's clip_grad_norm_ takes them (the grad norm's shares).
foreach_norm = _require("torch", "_foreach_norm")


def flatten_mesh(mesh: Any, name: str) -> Any:  # (name: one no mesh dim of the user's can have)
    """A 1-D mesh over every rank of `mesh` (a sub-mesh of several dims), made from it: its
    groups are derived from the root mesh's, so FSDP over it composes with tensor parallelism
    over the root's other dims.  DeviceMesh._flatten has no public name in torch 2.13."""
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise ComposerunTorchCompatError(
            f"composerun flattens mesh dims with DeviceMesh._flatten, which torch {torch.__version__} lacks "
            f"(tested with torch {TESTED[0][0]}.{TESTED[0][1]})"
        )
    return flatten(name)


def set_activation_memory_budget(budget: float) -> None:
    """The compiler's activation-memory budget (checkpoint mode budget): 0 recomputes what it
    can, 1 keeps everything (torch's default).  A process-wide setting of torch._functorch."""
    import torch._functorch.config as functorch_config

    if not hasattr(functorch_config, "activation_memory_budget"):
        raise ComposerunTorchCompatError(
            f"checkpoint mode budget sets torch._functorch.config.activation_memory_budget, which torch "
            f"{torch.__version__} lacks (tested with torch {TESTED[0][0]}.{TESTED[0][1]})"
        )
    functorch_config.activation_memory_budget = budget


def is_compile_error(e: BaseException) -> bool:
    """Whether `e` is torch.compile's failure to compile (dynamo, a backend, inductor), as
    opposed to an error the compiled code raised as eager code would."""
    import torch._dynamo.exc as dynamo_exc

    if isinstance(e, dynamo_exc.BackendCompilerFailed | dynamo_exc.Unsupported | dynamo_exc.UserError):
        return True
    inductor_error = getattr(importlib.import_module("torch._inductor.exc"), "InductorError", None)
    return inductor_error is not None and isinstance(e, inductor_error)


# DTensor's collectives (tensor parallelism's redistributions, loss_parallel's reductions) are
# these functions of torch.distributed._functional_collectives, looked up on the module at
# every call (torch 2.13: tensor/_collective_utils.py, placement_types.py, parallel/loss.py).
_FUNCTIONAL_COLLECTIVES = {
    "all_gather": "all_gather_single",
    "reduce_scatter": "reduce_scatter_single",
    "all_reduce": "all_reduce",
}


@contextmanager
def recording_functional_collectives(record: Any) -> Iterator[None]:
    """Call `record(kind, tensor)` with the input of every all-gather, reduce-scatter and
    all-reduce of torch's functional collectives this process issues inside, in this thread or
    any: the collectives of tensor parallelism's styles and loss_parallel (parallel/tp_comm.py).
    (A Shard-to-Shard redistribution's all-to-all, which composerun's styles do not make, is
    not recorded.)"""
    funcol = importlib.import_module("torch.distributed._functional_collectives")
    saved = {name: _require(funcol.__name__, name) for name in _FUNCTIONAL_COLLECTIVES.values()}

    def wrap(kind: str, fn: Any) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            record(kind, tensor)
            return fn(tensor, *args, **kwargs)

        return call

    try:
        for kind, name in _FUNCTIONAL_COLLECTIVES.items():
            setattr(funcol, name, wrap(kind, saved[name]))
        yield
    finally:
        for name, fn in saved.items():
            setattr(funcol, name, fn)


def shards(placement: Any) -> bool:
    """Whether a DTensor placement splits the tensor: Shard, or the _StridedShard that FSDP
    gives a dim tensor parallelism already split (torch 2.13: no Shard subclass, and private)."""
    from torch.distributed.tensor import Shard

    strided = getattr(importlib.import_module("torch.distributed.tensor.placement_types"), "_StridedShard", ())
    return isinstance(placement, (Shard, strided))


# The pre-flight estimate's tools (parallel/estimate.py): torch's fake tensors, its memory
# trackers (torch.distributed._tools) and its table of FLOP formulas per op.
def fake_tensor_mode() -> Any:
    """A FakeTensorMode that also takes the meta model's real-looking inputs (tensors made
    outside it are converted)."""
    mode = _require("torch._subclasses.fake_tensor", "FakeTensorMode")
    return mode(allow_non_fake_inputs=True)


def memory_tracker(model: nn.Module, optim: Any = None) -> Any:
    """torch's FSDPMemTracker for a model whose root is an FSDP (or replicate) unit, its
    MemTracker (watching the model) for any other; either a context manager whose
    get_tracker_snapshot("peak") gives {device: {category: bytes, "Total": bytes}}.  With
    `optim`, its state is tracked too."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return _require("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker")(model, optim)
    tracker = _global_peak_tracker()()
    tracker.track_external(model, *([optim] if optim is not None else []))
    return tracker


def _global_peak_tracker() -> type:
    """MemTracker keeping the global peak only: its own keeps every module's local peak too,
    a pass over every module for every op (30 s of an 8B model's fake step on one rank, for
    figures composerun does not read).  Its private snapshot fields, checked on first use."""
    base = _require("torch.distributed._tools.mem_tracker", "MemTracker")
    total = _require("torch.distributed._tools.mem_tracker", "_TOTAL_KEY")

    class GlobalPeakMemTracker(base):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            if not all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
                return super()._update_peak_stats(peak_state)
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[total]:
                    self._peak_mem[dev] = snap[total]
                    self._peak_mem_snap[dev] = dict(snap)

    return GlobalPeakMemTracker


def post_backward_snapshots(tracker: Any) -> list[dict[str, int]]:
    """Every snapshot an FSDPMemTracker took right after an FSDP unit's post-backward (its
    reduce-scatter issued): {category: bytes, "Total": bytes} each; [] for a MemTracker.
    The tracker keeps them per module in `memory_tracking` (no public getter)."""
    stats = getattr(tracker, "memory_tracking", None)
    state = getattr(importlib.import_module("torch.distributed._tools.fsdp2_mem_tracker"), "_FSDPModState", None)
    if stats is None or state is None:
        return []
    out = []
    for mod_stats in list(stats.values()):
        for snap in getattr(mod_stats, "snapshots", {}).get(state.AFT_POST_BW, []):
            for per_device in snap.values():
                out.append({str(getattr(k, "value", k)): int(v) for k, v in per_device.items()})
    return out


def next_iteration(tracker: Any) -> None:
    """Before a module's forward runs again inside one tracker (the next micro-batch):
    FSDPMemTracker refuses a second forward of a unit unless its per-module statistics are
    cleared (reset_mod_stats), which keeps the global peak."""
    reset = getattr(tracker, "reset_mod_stats", None)
    if reset is not None:
        reset()


def flop_formulas() -> dict[Any, Any]:
    """{op overload packet: its FLOP formula}, torch's own (torch.utils.flop_counter), with
    the CPU flash-attention kernels (what SDPA dispatches to on a CPU, the fake step's device)
    counted as the CUDA flash kernels they mirror (torch's table has no entry for them)."""
    table = dict(_require("torch.utils.flop_counter", "flop_registry"))
    aten = torch.ops.aten
    for cpu, cuda in (
        ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward"),
    ):
        if hasattr(aten, cpu) and getattr(aten, cuda) in table:
            table.setdefault(getattr(aten, cpu), table[getattr(aten, cuda)])
    return table


def compile_backward_eagerly() -> None:
    """Have AOTAutograd compile a compiled module's backward at its first forward, not at its
    first backward (torch._functorch's `force_non_lazy_backward_lowering`, process-wide), so
    that a backward the compiler cannot compile fails where compile.fallback catches it."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        functorch_config.force_non_lazy_backward_lowering = True


def fake_tensor_failure(e: BaseException) -> str | None:
    """The op a forward on fake tensors could not run, when `e` says so: one that needs the
    values (a read to the host), or has no fake implementation; None for any other error."""
    fake = importlib.import_module("torch._subclasses.fake_tensor")
    kinds = tuple(
        getattr(fake, n)
        for n in ("DataDependentOutputException", "UnsupportedOperatorException", "DynamicOutputShapeException")
        if hasattr(fake, n)
    )
    if isinstance(e, kinds):
        return str(getattr(e, "func", "") or e)
    return None


def registered_apis(module: nn.Module) -> list[str]:
    """Names of the composable APIs applied to `module`, in the order applied."""
    return list(_get_registry(module) or {})


def module_state_name(module: nn.Module) -> str | None:
    """Class name of the composable state torch keeps for `module` (FSDPState, ...)."""
    state = _get_module_state(module)
    return None if state is None else type(state).__name__


def fsdp_offload_policy(module: nn.Module) -> Any:
    """The OffloadPolicy fully_shard keeps for `module`'s own parameters (CPUOffloadPolicy:
    their shards live on the CPU), or None (not a fully_shard unit, or none of its own).
    torch has no public getter; its FSDP state's parameter group holds it."""
    group = getattr(_get_module_state(module), "_fsdp_param_group", None)
    return None if group is None else group.offload_policy


def init_fake_process_group(rank: int, world_size: int) -> None:
    """torch's fake process group as the default group: collectives are no-ops, so one
    process can apply a policy as any rank of any mesh (PITFALLS §5).  Its store lives in
    torch's private testing package."""
    import torch.distributed as dist

    fake_store = _require("torch.testing._internal.distributed.fake_pg", "FakeStore")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())


# --- DCP checkpoint files: what composerun's writer and reader rely on --------------------------

_DCP = "torch.distributed.checkpoint"
# torch's own allow-list of the weights_only unpickler ({"module.name": object}): torch.Size,
# every dtype, torch.serialization._get_layout, OrderedDict, ... (what torch itself pickles)
_torch_weights_only_globals = _require("torch._weights_only_unpickler", "_get_allowed_globals")


def _tested() -> str:
    return f"{TESTED[0][0]}.{TESTED[0][1]}"


def use_file_system(writer: Any, fs: Any) -> None:
    """Have DCP's FileSystemWriter write every file of a save (data files, `.metadata`)
    through `fs`, a torch.distributed.checkpoint.FileSystemBase, and rename through it.
    The writer keeps its file system in its `fs` attribute (DCP's own fsspec writer sets
    its own there); that attribute is not documented, so it is checked before it is set."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    if not isinstance(getattr(writer, "fs", None), FileSystemBase):
        raise ComposerunTorchCompatError(
            f"composerun writes checkpoints through {type(writer).__name__}.fs, a FileSystemBase, which "
            f"torch {torch.__version__} no longer has (tested with torch {_tested()})"
        )
    writer.fs = fs


_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextmanager
def no_zip_crc32() -> Iterator[None]:
    """torch.save writes no CRC-32 into its zip records while any caller is inside (DCP's
    writer threads and an async save's thread may be at once: they are counted), and torch's
    setting as it was found comes back when the last one leaves.  torch's switch
    (torch.serialization.set_crc32_options) is process-wide: a torch.save elsewhere in the
    process meanwhile writes none either; torch.load reads files with and without."""
    global _crc_users, _crc_before
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                torch.serialization.set_crc32_options(_crc_before)


class ItemLocation(NamedTuple):
    """Where DCP stored one item: a byte range of one file of the checkpoint folder."""

    relative_path: str
    offset: int
    length: int
    transformed: bool  # written through DCP's stream transforms: not torch.save's bytes as they are

    @property
    def end(self) -> int:
        return self.offset + self.length


def item_locations(metadata: Any) -> dict[Any, ItemLocation]:
    """{MetadataIndex: ItemLocation} of every stored item, from the metadata's `storage_data`,
    whose values are DCP's private _StorageInfo records (filesystem.py)."""
    out = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        try:
            path, offset, length = info.relative_path, info.offset, info.length
            out[index] = ItemLocation(str(path), int(offset), int(length), bool(info.transform_descriptors))
        except (AttributeError, TypeError, ValueError):
            raise ComposerunTorchCompatError(
                f"DCP metadata's storage_data holds {type(info).__name__}, not the records of (relative_path, "
                f"offset, length, transform_descriptors) composerun reads (torch {torch.__version__}, "
                f"tested with torch {_tested()})"
            ) from None
    return out


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # zip local file header: signature ... name and extra lengths


def tensor_record_offset(item: IO[bytes], nbytes: int) -> int | None:
    """Where the raw bytes of a tensor start in `item`, a seekable stream holding what
    torch.save wrote for one tensor, when they lie there as they are in memory: the archive
    holds one storage record (`<archive>/data/<key>`) of exactly `nbytes`, stored
    uncompressed, and its `<archive>/byteorder` record is this machine's.  None otherwise
    (the caller reads the item through torch.load then).  The zip directory is read with
    zipfile and the record's local header by hand, not with zipfile's read(), which tests a
    CRC-32 that composerun's saves leave out (no_zip_crc32)."""
    item.seek(0)
    try:
        zf = zipfile.ZipFile(item)
    except zipfile.BadZipFile:
        return None
    names = zf.namelist()
    root = names[0].split("/", 1)[0] if names else ""
    records = [n for n in names if n.startswith(f"{root}/data/")]
    if len(records) != 1 or f"{root}/byteorder" not in names:
        return None
    order_info = zf.getinfo(f"{root}/byteorder")
    order = _record_start(item, order_info)
    if order is None:
        return None
    item.seek(order)
    if item.read(order_info.file_size) != sys.byteorder.encode():
        return None
    info = zf.getinfo(records[0])
    return _record_start(item, info) if info.file_size == nbytes else None


def _record_start(item: IO[bytes], info: zipfile.ZipInfo) -> int | None:
    """Where a stored (uncompressed) zip record's bytes start: after its local header."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    item.seek(info.header_offset)
    header = item.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


# Outside torch: the checkpoint's id (a path) and containers DCP's records may hold.
_METADATA_GLOBALS = {("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")} | {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("collections", "OrderedDict"),
}


def _is_dcp_record(obj: Any) -> bool:
    """A class DCP defines to hold data: an Enum, or a dataclass whose __init__ is the one
    dataclasses writes (it only stores its fields).  DCP's metadata classes are all such,
    new ones too; its writers, readers and functions are not."""
    if not isinstance(obj, type) or not str(obj.__module__).startswith(_DCP + "."):
        return False
    if issubclass(obj, enum.Enum):
        return True
    params = getattr(obj, "__dataclass_params__", None)
    return dataclasses.is_dataclass(obj) and params is not None and params.init


class _MetadataUnpickler(pickle.Unpickler):
    """Imports nothing but DCP's record classes (_is_dcp_record), the globals torch's own
    weights_only loading allows (its built-in list and torch.serialization.add_safe_globals'),
    and a few of Python's (_METADATA_GLOBALS)."""

    def __init__(self, f: IO[bytes]) -> None:
        super().__init__(f)
        self.allowed = set(_torch_weights_only_globals())
        for g in torch.serialization.get_safe_globals():  # objects, or (object, "module.name")
            self.allowed.add(g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}")

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_DCP + ".") or module == _DCP:
            obj = super().find_class(module, name)  # (importing a module of torch's own)
            if _is_dcp_record(obj):
                return obj
        elif (module, name) in _METADATA_GLOBALS or f"{module}.{name}" in self.allowed:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in DCP metadata (only DCP's record classes and torch's safe "
            "globals are; to trust it, torch.serialization.add_safe_globals)"
        )


def load_dcp_metadata(f: IO[bytes]) -> Any:
    """DCP's `.metadata` (a pickle of its Metadata), unpickled without importing anything
    else: a damaged or hostile file raises pickle.UnpicklingError (or what a broken pickle
    raises: EOFError, ValueError, ...) instead of running code.  DCP's own reader unpickles
    it with pickle.load, which imports whatever the file names."""
    return _MetadataUnpickler(f).load()


def held_gradient_elements(model: nn.Module) -> int:
    """Gradient elements this rank holds now: its parameters' gradients (local shards), and
    the whole gradients FSDP keeps between the micro-batches whose reduce-scatter is deferred
    (an FSDPParam's unsharded parameter's `.grad`, or its `unsharded_accumulated_grad` in
    reduce_dtype).  For tests and the memory benchmark of gradient accumulation."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    held = 0
    for p in model.parameters():
        if p.grad is not None:
            held += (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).numel()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else []:
            if fp.unsharded_accumulated_grad is not None:
                held += fp.unsharded_accumulated_grad.numel()
            elif hasattr(fp, "_unsharded_param") and fp._unsharded_param.grad is not None:
                held += fp._unsharded_param.grad.numel()
    return held


def shutdown_loader_workers(batches: Any, grace: float = 5.0) -> None:
    """End a DataLoader iterator's worker processes now (composerun/data/loader.py), whatever
    still refers to the iterator (a traceback through its __next__ keeps it from being
    deleted, and so from shutting its workers down): the DataLoader's own shutdown (the
    end signal, a join of 5 s each, then SIGTERM, which composerun's workers ignore), then
    SIGKILL and a join for a worker still alive, so that no process is left for
    multiprocessing's exit handler to wait for.  A single-process iterator has no workers."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is None:
        return
    shutdown()
    for worker in getattr(batches, "_workers", []):
        if worker.is_alive():
            worker.kill()
        worker.join(grace)
