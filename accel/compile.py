"""The CPU-specialised compiled decode walk: `compile_decode(model)` is the model's own `compile_decode` (one graph per
loop pass of `walk_run`) plus, on CPU,

- each attention's input projections as one GEMM (`fusion`), each product of the walk taken by the fastest of
  `FewRowsKernel`'s traceable products, timed on this machine for one row and for a batch
  (`choose_compiled_products`, kept in `compiled_products.json` beside the stored walks);
- float32 weights that keep F.linear stored column-major, which MKL reads faster for a few rows;
- inductor's pattern matcher off (its one-query attention rewrite swaps in a slower CPU kernel);
- the compiled walk kept across processes (`PersistentDecodeWalk`, on torch's `aot_compile`).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import os
import stat
import sys
import tempfile
import uuid

import torch
import transformers
from torch import nn
from transformers.utils import logging

from .fusion import fuse_input_projections, fused as fused_of, unfuse_input_projections
from .kernels import (
    COMPILED_BATCH_ROWS,
    COMPILED_PRODUCTS,
    FEW_ROWS_DTYPES,
    FEW_ROWS_KERNEL,
    FEW_ROWS_MIN_WEIGHT,
    FewRowsKernel,
    FewRowsLinear,
    compiled_kinds,
    cpu_model,
    product_key,
    weight_only_int8,
)

logger = logging.get_logger(__name__)


def _modeling(model):
    """The model's own modeling module (remote code loads its own copy)."""
    return sys.modules[type(model).__module__]


def _generation(model):
    """The model's own generation_utils module, the modeling module's sibling."""
    return sys.modules[type(model).__module__.rpartition(".")[0] + ".generation_utils"]


def compile_decode(model, enable: bool = True, persistent: bool = True, **compile_kwargs) -> None:
    """`model.compile_decode` specialised for CPU (see the module docstring); on another device it is the model's own.
    `persistent`: keep the walk and the product choices for later processes (inductor backend, plain weights, no CUDA
    graphs). `enable=False` returns to eager decoding and stores column-major weights row-major again."""
    own = type(model).compile_decode
    if not enable or model.device.type != "cpu":
        reset_compiled_products(model)
        own(model, enable=False)
        fuse_input_projections(model)  # eager decoding fuses the FFN's gate and up again
        if not enable:
            return
        own(model, **compile_kwargs)
        return
    modeling, generation = _modeling(model), _generation(model)
    options, compile_kwargs = generation.decode_compile_options(model.model, compile_kwargs)  # raises where it cannot
    reset_compiled_products(model)
    inductor = compile_kwargs.get("backend", "inductor") == "inductor"
    # The walk multiplies the FFN's gate and up by their own chosen products; each attention's projections as one.
    ffns = [layer.ffn for layer in model.model.layers]
    unfuse_input_projections(model, ffns)
    fuse_input_projections(model, [layer.attn for layer in model.model.layers])
    choose_compiled_products(model, persistent and inductor, reduce=inductor)
    with torch.no_grad():
        for linear in column_major_linears(model):
            # float32 only, where MKL reads it faster; a quantized weight keeps its own layout, and a column-major
            # bf16 weight is far slower on a CPU without bf16 instructions.
            if (type(linear.weight.data) is torch.Tensor and linear.weight.dtype == torch.float32
                    and compiled_kinds(linear) == ("linear", "linear")):
                linear.weight.data = linear.weight.data.t().contiguous().t()
    # The pattern matcher also holds inductor's lowering of torchao's int8 product, which the walk's int8 weights
    # do not need where each takes an int8 product of its own.
    if all(type(p.data) is torch.Tensor or isinstance(m, FewRowsLinear) and compiled_kinds(m)[0].startswith("int8")
           for m in model.model.layers.modules() for p in m.parameters(recurse=False)):
        options.setdefault("pattern_matcher", False)
    plain_weights = all(type(p.data) is torch.Tensor for p in model.parameters())
    # Below transformers 5.24 the decoder layers' wrapped forward holds closures whose guards a stored walk cannot
    # rebuild, so the walk is compiled in this process there.
    stored_guards_hold = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 24)
    if (persistent and stored_guards_hold and plain_weights and inductor
            and not torch._inductor.config.force_disable_caches and not options.get("triton.cudagraphs")):
        walk = PersistentDecodeWalk(model.model, options, compile_kwargs)
    else:
        walk = generation.compile_walk(modeling.walk_run, options, compile_kwargs)

    def compiled_run(*args):
        # Weights given new storage since fusing are fused again, outside the graph.
        for layer in model.model.layers:
            f = vars(layer.attn).get("input_projections")
            if f is not None and f.fused is not None and not f.fused.intact():
                f.refuse()
        return walk(*args)

    compiled_run.walk = walk  # the compiled (or stored) walk itself
    model.model._compiled_run = compiled_run
    model.model._compiled_for = (model.model.embed_tokens.weight.dtype, model.model.embed_tokens.weight.device)


def reset_compiled_products(model) -> None:
    """Drop the walk's prepacked copies and column-major layouts: a clean start. The choices stay in
    `COMPILED_PRODUCTS`, answers for their problems in this process (the eager forward never reads them; the next
    `choose_compiled_products` sets this model's again)."""
    for owner in compiled_owners(model):
        if "packed" in compiled_kinds(owner):
            FewRowsKernel.packed.pop(owner.weight, None)
    with torch.no_grad():
        for linear in column_major_linears(model):
            if type(linear.weight.data) is torch.Tensor and not linear.weight.is_contiguous():
                linear.weight.data = linear.weight.data.contiguous()


def choose_compiled_products(model, persistent: bool, reduce: bool = True) -> None:
    """Sets `COMPILED_PRODUCTS` for each of `compiled_owners`' weights: the products `FEW_ROWS_KERNEL` takes for one
    row and for `COMPILED_BATCH_ROWS` rows (timed on the model's weights, see `FewRowsKernel.choose`; F.linear for a
    weight it does not time) in the compiled walk: the fastest product for one row can be the slowest for a batch, so
    each graph takes its own.
    `persistent`: the choices are kept in `compiled_products.json` beside the stored walks and reused by later
    processes, whose stored walk (keyed on them) would otherwise be compiled again after a near-tie timed the
    other way."""
    root = PersistentDecodeWalk.root() if persistent else None
    path = None
    if persistent and PersistentDecodeWalk.private_folder(root):
        path = os.path.join(root, "compiled_products.json")
    stored: dict[str, str] = {}
    data = read_private(path) if path is not None else None
    with contextlib.suppress(ValueError):  # another format, or cut short: timed again
        stored = json.loads(data) if data is not None else {}
    if not isinstance(stored, dict):
        stored = {}
    before = dict(stored)
    owners = [o for o in compiled_owners(model) if o.weight.numel() >= FEW_ROWS_MIN_WEIGHT and (
        weight_only_int8(o.weight) or type(o.weight.data) is torch.Tensor
        and o.weight.dtype in FEW_ROWS_DTYPES and o.weight.is_contiguous())]
    # What a decode step reads between two reads of one of them: every plain weight of the layers, in order (a
    # fused matrix in place of its blocks).
    walk, fused = [], set()
    for m in model.model.layers.modules():
        if fused_of(m) is not None:
            walk.append(fused_of(m).weight)
            fused.update(id(linear) for linear in fused_of(m).linears)
        elif (isinstance(m, nn.Linear) and id(m) not in fused and type(m.weight.data) is torch.Tensor
              and m.weight.dtype.is_floating_point):
            walk.append(m.weight)
    weights = [o.weight for o in owners]
    with torch.no_grad():
        one = FEW_ROWS_KERNEL.choose(weights, 1, stored, walk, reduce=reduce)
        several = FEW_ROWS_KERNEL.choose(weights, COMPILED_BATCH_ROWS, stored, walk,
                                         keep=[w for w, kind in zip(weights, one) if kind == "packed"])
    kinds = {product_key(o.weight, rows): "linear" for o in compiled_owners(model) for rows in (False, True)}
    for weight, kind, kind_rows in zip(weights, one, several):
        kinds[product_key(weight, False)], kinds[product_key(weight, True)] = kind, kind_rows
    for key, kind in kinds.items():
        if kind == "linear":
            COMPILED_PRODUCTS.pop(key, None)
        else:
            COMPILED_PRODUCTS[key] = kind
    if path is not None and stored != before:
        write_private(path, json.dumps(stored, indent=1, sort_keys=True).encode())


def compiled_owners(model) -> list:
    """What the compiled walk multiplies by a chosen product: each attention's fused input projections and every
    other `FewRowsLinear` of the decoder layers (of a SpikeWhaleForCausalLM or its SpikeWhaleModel)."""
    layers = getattr(model, "model", model).layers
    fused = [f for f in (fused_of(layer.attn) for layer in layers) if f is not None]
    in_fused = {id(linear) for f in fused for linear in f.linears}
    return [m for m in layers.modules() if isinstance(m, FewRowsLinear) and id(m) not in in_fused] + fused


def column_major_linears(model) -> list[nn.Linear]:
    """The Linears whose one-token GEMMs MKL runs faster column-major: the FFN's, and the rank→hidden
    up-projections (q_b, o_b, the Memory Cache's o_proj)."""
    linears = []
    for layer in model.model.layers:
        attn, ffn = layer.attn, layer.ffn
        if hasattr(ffn, "gate_proj") and not hasattr(ffn, "experts"):
            linears += [ffn.gate_proj, ffn.up_proj, ffn.down_proj]
        linears += [attn.q_b_proj, attn.o_b_proj] + ([attn.mc.o_proj] if attn.mc is not None else [])
    return linears


def stored_decode_guards(compiled_decode_guards):
    """The guard filter of a stored walk: the modeling file's `compiled_decode_guards` less the identity checks torch
    cannot store (`PersistentDecodeWalk`): that a function, class or module is the very object traced (the
    namedtuple constructors' scopes included). Its key holds the package's source instead; guards on values, shapes
    and structure stay."""
    from torch._dynamo.guards import CheckFunctionManager

    unstorable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)

    def keep(entries) -> list[bool]:
        return [
            kept and e.guard_type not in unstorable and not unstorable.intersection(e.derived_guard_types or ())
            and "___unnamed_scope" not in e.name
            for kept, e in zip(compiled_decode_guards(entries), entries)
        ]

    return keep


def triton_version() -> str | None:
    """Triton's version where it is installed (it writes a GPU walk's kernels), else None."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def owned_privately(st: os.stat_result, kind) -> bool:
    """Whether a cache entry (its `lstat`/`fstat`) is of `kind` (`stat.S_ISDIR`, `stat.S_ISREG`; a link is neither),
    owned by this user and writable by no one else. Without uids (Windows, whose temp folder is per user) only the
    kind is checked."""
    getuid = getattr(os, "getuid", None)
    return kind(st.st_mode) and (getuid is None or (st.st_uid == getuid() and not st.st_mode & 0o022))


def read_private(path: str) -> bytes | None:
    """A file's bytes where it is this user's alone (`owned_privately`, opened without following a link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read() if owned_privately(os.fstat(fd), stat.S_ISREG) else None


def write_private(path: str, data: bytes) -> None:
    """Writes `path` whole or not at all (also with another process writing), readable by this user only."""
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(path))  # created 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


class PersistentDecodeWalk:
    """`walk_run` compiled for decode steps and kept in torch's cache directory, so that a later process decoding
    with the same model skips dynamo's trace of the walk (most of a first compiled step once inductor's own caches
    are warm; issue 12: 12.6 s for the 114M preset).

    Each graph is compiled ahead of time by torch (`torch.compile(walk_run, fullgraph=True).aot_compile`, inductor's
    code bundled in) and written to `<torch cache dir>/spike_whale_decode/<key>/`, under the directory inductor uses
    (`TORCHINDUCTOR_CACHE_DIR`, by default /tmp/torchinductor_<user>); nothing is written next to the model. The key
    hashes the torch, transformers and Python versions, the source and module name of this package, the compile
    options, the thread count (CPU kernels specialise on it), the CPU's model and vector ISA or the GPU's name and
    capability, every layer parameter's name, shape, stride, dtype and device, and the products the walk's Linears
    and fused projections take (`compiled_kind`), since the stored guards cannot check what identity guards check
    in-process (`stored_decode_guards`). A call runs the first stored graph whose guards pass, else compiles, stores
    and runs a new one (a new batch size, say).

    A stored graph is code (bytecode and inductor's kernels, which torch's loader unpickles and runs, as it does its
    own caches'), so only this user's own entries are read: both folders are created 0700, and a folder or file that
    another user owns or may write, or a link, is neither read nor written (`owned_privately`; the walk then compiles
    in this process). An entry that cannot be read back (cut short, or from another build) is compiled again.
    `options` and `compile_kwargs` are `torch.compile`'s (inductor backend; the walk is always one graph, `fullgraph`)."""

    def __init__(self, model: nn.Module, options: dict, compile_kwargs: dict):
        options = {k: v for k, v in options.items() if k != "guard_filter_fn"}
        compile_kwargs = {k: v for k, v in compile_kwargs.items() if k not in ("fullgraph", "backend")}
        self.walk_run = _modeling(model).walk_run
        self.compile = torch.compile(self.walk_run, fullgraph=True, **compile_kwargs, options={
            **options, "guard_filter_fn": stored_decode_guards(_generation(model).compiled_decode_guards)})
        self.folder = os.path.join(self.root(), self.key(model, options, compile_kwargs))
        self.graphs = []
        self.unread: list[str] | None = None  # stored graphs not read yet, listed on the first call
        self.stores = True  # False once the folder is found not to be this user's alone

    @staticmethod
    def root() -> str:
        """The folder of every stored walk (one subfolder per key) and of `compiled_products.json`."""
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return os.path.join(cache_dir(), "spike_whale_decode")

    @classmethod
    def private_folder(cls, folder: str) -> bool:
        """Creates `root()` and `folder` below it (0700) where absent; whether both are this user's alone (else a
        warning: nothing is read from or stored there)."""
        for path in dict.fromkeys((cls.root(), folder)):
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                private = owned_privately(os.lstat(path), stat.S_ISDIR)
            except OSError:
                private = False
            if not private:
                logger.warning_once(
                    f"{path} is another user's, writable by others or a link, so compiled decode walks are neither "
                    "read from nor stored there; set TORCHINDUCTOR_CACHE_DIR to a folder of your own to keep them."
                )
                return False
        return True

    @staticmethod
    def key(model: nn.Module, options: dict, compile_kwargs: dict) -> str:
        # The module's name too: the stored code imports this package's modules by name (`spike_whale.*`, or
        # transformers_modules.* under trust_remote_code); and its folder, which the stored graphs' guards read (the
        # same sources elsewhere would add a graph to the entry, and every later process would load them all). The
        # machine's kernels: inductor's CPU code targets this CPU's vector ISA, its GPU code the device's capability.
        devices = sorted({p.device for p in model.layers.parameters()}, key=str)
        machine = [(torch.cuda.get_device_name(d), torch.cuda.get_device_capability(d)) if d.type == "cuda"
                   else (d.type, cpu_model(), torch.backends.cpu.get_cpu_capability()) for d in devices]
        walk_module = type(model).__module__
        package = os.path.dirname(os.path.abspath(sys.modules[walk_module].__file__))
        digest = hashlib.sha256(repr((torch.__version__, triton_version(), transformers.__version__, sys.version,
                                      walk_module, package, torch.get_num_threads(), machine,
                                      sorted(options.items()), sorted(compile_kwargs.items()))).encode())
        here = os.path.dirname(os.path.abspath(__file__))  # the products the walk traces are this package's
        for path in sorted(glob.glob(os.path.join(package, "*.py")) + glob.glob(os.path.join(here, "*.py"))):
            with open(path, "rb") as f:
                digest.update(f.read())
        for name, p in model.layers.named_parameters():
            digest.update(repr((name, tuple(p.shape), p.stride(), p.dtype, p.device.type, type(p.data))).encode())
        names = {id(m): name for name, m in model.layers.named_modules()}
        for owner in compiled_owners(model):
            kinds = compiled_kinds(owner)
            if kinds != ("linear", "linear"):
                label = names[id(owner)] if id(owner) in names else f"{names[id(owner.linears[0])]}.fused_input"
                digest.update(repr((label, *kinds)).encode())
        return digest.hexdigest()[:32]

    def __call__(self, *args):
        for graph in self.graphs:
            if graph.guard_check(*args):
                return graph.fn(*args)
        if self.unread is None:
            self.stores = self.private_folder(self.folder)
            self.unread = sorted(glob.glob(os.path.join(self.folder, "*.bin"))) if self.stores else []
        # Read only as far as the first stored graph that fits (other batch sizes' wait until they are needed).
        # A graph stored for this batch size first: each other one read is a load that fails its guards.
        batch = f"b{args[1].shape[0]}-" if len(args) > 1 and isinstance(args[1], torch.Tensor) else ""
        self.unread.sort(key=lambda path: not os.path.basename(path).startswith(batch))
        while self.unread:
            path = self.unread.pop(0)
            data = read_private(path)
            if data is None:
                continue
            try:
                graph = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=self.walk_run.__globals__)
            except Exception:  # cut short or stale, a stored entry can fail anywhere in torch's loader
                logger.info(f"{path} could not be read back; compiling the walk again")
                with contextlib.suppress(OSError):
                    os.remove(path)
                continue
            self.graphs.append(graph)
            if graph.guard_check(*args):
                return graph.fn(*args)
        with torch._dynamo.config.patch(specialize_float=True):  # as compile_decode's in-process walk
            graph = self.compile.aot_compile((args, {}))
        if self.stores:  # written whole (a renamed temporary file), 0600
            graph.save_compiled_function(os.path.join(self.folder, f"{batch}{uuid.uuid4().hex}.bin"))
        self.graphs.append(graph)
        return graph.fn(*args)


