"""SpikeWhale v2 / Byrne configuration.

Every field of the family's `config.py` is kept with the same name and default, so a released `config.json` loads
through `SpikeWhaleConfig(**json)`. Three defaults that contradict the released checkpoints are corrected:
`bos_token_id=2`, `eos_token_id=3` (the 0/1 defaults point at `<pad>`/`<unk>`) and an explicit `pad_token_id=0`."""

from __future__ import annotations

import copy
import dataclasses
import glob
import importlib
import json
import math
import os
import re
from dataclasses import dataclass

from safetensors import safe_open
from transformers import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Token ids of the serving defaults, known without the tokenizer (`tokenization_spike` keeps copies, tested equal).
CHAT_EOS_IDS = (3, 16385)  # <eos>, <|im_end|>
RESERVED_IDS = range(16401, 16512)  # <|reserved_special_0..110|>


def _declared_fields(cls) -> list[str]:
    """The typed fields a config class declares (its own and its SpikeWhale bases'), in declaration order."""
    names = []
    for klass in reversed(cls.__mro__):
        if klass.__module__ == __name__:
            names += [n for n in vars(klass).get("__annotations__", {}) if n not in names]
    return names


@dataclass(frozen=True)
class LoopPlan:
    """The ordered (layer, pass) walk of the looped stack; cache slot = index into `entries`. `pass_starts[i]` is True
    where a loop pass begins: the per-pass embedding is added there and the depth-attention state is reset."""

    entries: tuple[tuple[int, int], ...]
    pass_starts: tuple[bool, ...]

    @classmethod
    def from_config(cls, config: "SpikeWhaleConfig") -> "LoopPlan":
        n_layers, loops = config.num_hidden_layers, config.loop_count
        # "full" loops every layer, "middle_split" the middle `loop_middle_layers` (default half): the rest run once
        width = n_layers if config.loop_mode == "full" else config.loop_middle_layers or n_layers // 2
        head = (n_layers - width) // 2
        walk = [(layer, 0, False) for layer in range(head)]
        walk += [(layer, p, j == 0) for p in range(loops) for j, layer in enumerate(range(head, head + width))]
        walk += [(layer, loops - 1, False) for layer in range(head + width, n_layers)]
        return cls(tuple((layer, p) for layer, p, _ in walk), tuple(start for _, _, start in walk))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def runs(self) -> tuple[tuple[int, int, int | None], ...]:
        """The plan cut at pass starts: (first slot, end slot, pass begun or None); depth attention stays in its run."""
        cuts = [0] + [i for i, start in enumerate(self.pass_starts) if start and i > 0] + [len(self.entries)]
        return tuple((lo, hi, self.entries[lo][1] if self.pass_starts[lo] else None) for lo, hi in zip(cuts, cuts[1:]))


_PRESET_BYRNE_100M = dict(  # Byrne-100M-Ultra-MC, the base preset, as differences from the field defaults (config.py)
    hidden_size=768, max_position_embeddings=1024, tie_word_embeddings=True,
    num_attention_heads=12, q_lora_rank=128, qk_rope_head_dim=16, o_lora_rank=128,
    use_moe=False, moe_intermediate_size=2048, engram_compress_dim=32, engram_num_heads=2,
    hrm_refine_steps=1, hrm_refine_dim=128, use_abstain_head=False, use_memory_cache=True)

# Byrne-15M-Looped, the small looped sibling: layers, loops, MoE, heads, Elo, Engram table, HRM steps, abstain head
# and no Memory Cache as the 114M card states; hidden 384 with tied embeddings (config.py: mandatory at 15M), the
# ranks, Engram and HRM widths and the other switches inferred (18.76M total / 15.07M active).
_PRESET_BYRNE_15M_LOOPED = dict(
    _PRESET_BYRNE_100M, hidden_size=384, num_hidden_layers=10,
    num_attention_heads=8, num_key_value_heads=1, qk_rope_head_dim=32, q_lora_rank=64, o_lora_rank=64, use_elo=True,
    use_moe=True, moe_intermediate_size=160, n_routed_experts=4, engram_table_size=1024,
    hrm_refine_steps=3, hrm_refine_dim=256, use_abstain_head=True, use_depth_attention=False, use_memory_cache=False)

PRESETS: dict[str, dict] = {
    "byrne-15m-looped": dict(_PRESET_BYRNE_15M_LOOPED),
    "byrne-100m-ultra-mc": dict(_PRESET_BYRNE_100M),  # base_62k / dpo_3200 (trained at 1024 tokens)
    "byrne-100m-ultra-mc-sft": dict(_PRESET_BYRNE_100M, max_position_embeddings=4096),  # sft_7100: nothing else differs
    # The matched twin: Memory Cache off and geometric RoPE (106,032,018 parameters).
    "byrne-100m-nomc-stdrope": dict(_PRESET_BYRNE_100M, use_memory_cache=False, use_fractal_rope=False),
    "tiny": dict(  # every 114M mechanism on; used by `spike-whale init-tiny` and the demo
        _PRESET_BYRNE_100M, hidden_size=64, num_hidden_layers=4, max_position_embeddings=512,
        num_attention_heads=4, q_lora_rank=32, head_dim=16, qk_rope_head_dim=8, o_lora_rank=32,
        moe_intermediate_size=128, engram_compress_dim=8, engram_table_size=256, hrm_refine_dim=32,
        loop_count=2, depth_attention_stride=2, mc_segment_len=16, mc_num_heads=2, mc_head_dim=8, mc_gate_dim=16),
}


@dataclass(frozen=True)
class _Range:
    """Admitted values: integers (not bools) or finite numbers from `lo` to `hi`, minus the ends named in `excluded`."""

    integer: bool
    lo: float = -math.inf
    hi: float = math.inf
    excluded: str = ""

    def admits(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        above = self.lo < value if "lo" in self.excluded else self.lo <= value
        below = value < self.hi if "hi" in self.excluded else value <= self.hi
        return math.isfinite(value) and above and below

    def __str__(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        lo, hi = f"{self.lo:g}", f"{self.hi:g}"
        if math.isinf(self.lo) and math.isinf(self.hi):
            return kind
        if math.isinf(self.hi):
            return f"{kind} {'>' if 'lo' in self.excluded else '>='} {lo}"
        return f"{kind} in {'(' if 'lo' in self.excluded else '['}{lo}, {hi}{')' if 'hi' in self.excluded else ']'}"


_COUNT, _COUNT0 = _Range(True, 1), _Range(True, 0)
_POSITIVE, _NON_NEGATIVE, _FINITE = _Range(False, 0, excluded="lo"), _Range(False, 0), _Range(False)
_DROPOUT = _Range(False, 0, 1, excluded="hi")

# Every numeric field: its range, and the switch without which the model never reads it (its value is then free).
# A field whose default is None may also be None. Checked before anything is derived from the fields.
_NUMERIC_FIELDS: dict[str, tuple[_Range, str | None]] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "num_attention_heads",
                     "num_key_value_heads", "q_lora_rank", "head_dim", "o_lora_rank", "moe_intermediate_size",
                     "loop_count", "loop_middle_layers", "hc_sinkhorn_iters"), (_COUNT, None)),
    "qk_rope_head_dim": (_Range(True, 2), None), "num_nextn_predict_layers": (_COUNT0, None),
    **dict.fromkeys(("rms_norm_eps", "hc_eps"), (_POSITIVE, None)),
    "rope_theta": (_Range(False, 1, excluded="lo"), None), "fractal_rope_gamma": (_Range(False, 0, 1), None),
    **dict.fromkeys(("initializer_range", "zloss_coef", "mtp_loss_weight", "moe_aux_loss_coef", "abstain_loss_weight"),
                    (_NON_NEGATIVE, None)),
    **dict.fromkeys(("hidden_dropout", "attention_dropout"), (_DROPOUT, None)),
    "elo_k_init": (_FINITE, "use_elo"),
    **dict.fromkeys(("n_routed_experts", "num_experts_per_tok"), (_COUNT, "use_moe")),
    **dict.fromkeys(("n_shared_experts", "num_hash_layers"), (_COUNT0, "use_moe")),
    "routed_scaling_factor": (_POSITIVE, "use_moe"), "hc_mult": (_COUNT, "use_hyper_connections"),
    **dict.fromkeys(("engram_compress_dim", "engram_num_heads", "engram_table_size", "engram_max_ngram"),
                    (_COUNT, "use_engram")),
    "engram_gate_init_bias": (_FINITE, "use_engram"), "engram_fusion_dim": (_COUNT, "engram_fusion_layers"),
    **dict.fromkeys(("hrm_refine_steps", "hrm_refine_dim"), (_COUNT, "use_hrm_refine")),
    "hrm_gate_init": (_FINITE, "use_hrm_refine"), "abstain_pos_weight": (_POSITIVE, "use_abstain_head"),
    "abstain_threshold": (_Range(False, 0, 1, excluded="lohi"), "use_abstain_head"),
    "depth_attention_stride": (_COUNT, "use_depth_attention"),
    **dict.fromkeys(("mc_segment_len", "mc_num_heads", "mc_head_dim", "mc_gate_dim"), (_COUNT, "use_memory_cache")),
}


def registered_tp_styles() -> set[str]:
    """The tensor-parallel style names the installed transformers registers (the set and its module vary in 5.x)."""
    for module in ("transformers.distributed.tensor_parallel", "transformers.integrations.tensor_parallel"):
        try:
            return set(importlib.import_module(module).ALL_PARALLEL_STYLES)
        except (ImportError, AttributeError):
            continue
    return set()


class SpikeWhaleConfig(PretrainedConfig):
    r"""Configuration of a SpikeWhale v2 (Byrne) looped decoder; `from_preset` gives the released checkpoints' and the
    15M sibling's. Port choices: `hc_sinkhorn_iters`/`hc_eps` parameterise a Sinkhorn projection the static Byrne
    Hyper-Connections do not have, so only their defaults are accepted; Elo takes precedence over DERF; `hidden_dropout`
    drops each sub-layer output before the residual streams (training only)."""

    model_type = "spike_whale"
    _auto_class = "AutoConfig"
    # Scalars and helper fields of `SpikeWhaleCausalLMOutput` that `Trainer.predict` should not gather.
    keys_to_ignore_at_inference = ["cache", "last_hidden_state", "lm_loss", "z_loss", "mtp_loss", "hrm_loss",
                                   "abstain_loss", "moe_aux_loss", "abstain_threshold"]

    # Standard
    vocab_size: int = 16512
    hidden_size: int = 1024
    num_hidden_layers: int = 16
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    hidden_dropout: float = 0.0
    bos_token_id: int | None = 2
    eos_token_id: int | list[int] | None = 3
    pad_token_id: int | None = 0
    use_cache: bool = True
    # MLA attention
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    q_lora_rank: int = 512
    head_dim: int = 64
    qk_rope_head_dim: int = 32
    o_lora_rank: int = 341
    attention_dropout: float = 0.0
    rope_theta: float = 10000.0
    # DERF, XSA, Elo, fractal RoPE
    use_derf: bool = False
    use_xsa: bool = True
    use_elo: bool = False
    elo_k_init: float = 0.5
    use_fractal_rope: bool = True
    fractal_rope_gamma: float = 1.0
    # MoE
    use_moe: bool = True
    moe_intermediate_size: int = 1408
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.0
    num_hash_layers: int = 2
    moe_aux_loss_coef: float = 0.01
    moe_layers: list[int] | None = None  # None: every layer
    # Hyper-Connections, MTP
    use_hyper_connections: bool = True
    hc_mult: int = 2
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    # Engram
    use_engram: bool = True
    engram_compress_dim: int = 64
    engram_num_heads: int = 4
    engram_table_size: int = 4096
    engram_max_ngram: int = 3
    engram_gate_init_bias: float = -1.0
    engram_legacy_hash: bool = False
    engram_fusion_layers: list[int] | None = None  # None: none
    engram_fusion_dim: int = 256
    # HRM refinement, abstain head
    use_hrm_refine: bool = True
    hrm_refine_steps: int = 3
    hrm_refine_dim: int = 256
    hrm_gate_init: float = 1.0
    hrm_deep_supervision: bool = True
    use_abstain_head: bool = True
    abstain_loss_weight: float = 0.1
    abstain_pos_weight: float = 8.0
    abstain_threshold: float = 0.6
    # Loop, depth attention
    loop_count: int = 3
    loop_pass_embed: bool = True
    loop_mode: str = "full"
    loop_middle_layers: int | None = None
    use_depth_attention: bool = True
    depth_attention_stride: int = 4
    # v2 additions, Memory Cache
    use_qk_norm: bool = True
    zloss_coef: float = 1e-4
    mtp_loss_weight: float = 0.3
    use_value_embed: bool = False
    use_memory_cache: bool = False
    mc_segment_len: int = 256
    mc_num_heads: int = 4
    mc_head_dim: int = 32
    mc_gate_dim: int = 64

    if not dataclasses.is_dataclass(PretrainedConfig):
        def __init__(self, **kwargs):
            """transformers releases whose configs are not dataclasses: set the declared fields, then `__post_init__`."""
            for name in _declared_fields(type(self)):
                setattr(self, name, kwargs.pop(name) if name in kwargs else copy.deepcopy(getattr(type(self), name)))
            tokens = {k: getattr(self, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")}
            super().__init__(**tokens, **kwargs)
            self.__post_init__()

    def __post_init__(self, **kwargs):
        kwargs.pop("nope_head_dim", None)  # derived; present in saved configs
        self.validate_numbers()
        self.nope_head_dim = self.head_dim - self.qk_rope_head_dim
        self.moe_layers = list(self.moe_layers) if self.moe_layers is not None else list(range(self.num_hidden_layers))
        self.engram_fusion_layers = list(self.engram_fusion_layers) if self.engram_fusion_layers is not None else []
        if hasattr(super(), "__post_init__"):
            super().__post_init__(**kwargs)
        self.validate_architecture()

    def validate_numbers(self) -> None:
        """Raise a `ValueError` naming the first numeric field outside its range (`_NUMERIC_FIELDS`): a NaN or
        negative epsilon, say, builds a model whose every logit is NaN."""
        for name, (allowed, switch) in _NUMERIC_FIELDS.items():
            value = getattr(self, name)
            nullable = value is None and getattr(type(self), name) is None
            if (switch is None or getattr(self, switch)) and not nullable and not allowed.admits(value):
                raise ValueError(f"SpikeWhaleConfig: `{name}` must be {allowed}, got {value!r}.")
        token_id = _Range(True, 0, self.vocab_size, excluded="hi")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            listed = name == "eos_token_id" and isinstance(value, list)
            if not all(i is None or token_id.admits(i) for i in (value if listed else [value])):
                raise ValueError(f"SpikeWhaleConfig: `{name}` must be None or a token id, {token_id} (the vocabulary)"
                                 f"{', or a list of them' if name == 'eos_token_id' else ''}, got {value!r}.")

    def validate_architecture(self) -> None:
        """transformers' validation hook, the one place every field is checked (a `ValueError` names the fields)."""

        def fail(msg: str) -> None:
            raise ValueError(f"SpikeWhaleConfig: {msg}")

        self.validate_numbers()
        if self.use_hrm_refine and self.hrm_gate_init == 0.0:
            fail("hrm_gate_init=0 with the zero-init `up` projection leaves the HRM block untrainable (zero gradient). "
                 "Use a non-zero hrm_gate_init (released: 1.0) or use_hrm_refine=False and hrm_deep_supervision=False.")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                 f"({self.num_key_value_heads}).")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim >= self.head_dim:
            fail(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even, at least 2 and smaller than head_dim "
                 f"({self.head_dim}); it is the rotated slice at the end of each head.")
        if self.loop_mode not in ("full", "middle_split"):
            fail(f"loop_mode must be 'full' or 'middle_split', got {self.loop_mode!r}.")
        m = self.loop_middle_layers
        if m is not None and (m > self.num_hidden_layers or self.num_hidden_layers % m):
            fail(f"loop_middle_layers ({m!r}) must divide num_hidden_layers ({self.num_hidden_layers}); use None for "
                 "num_hidden_layers // 2.")
        if self.engram_fusion_layers and not self.use_engram:
            fail(f"engram_fusion_layers={self.engram_fusion_layers} needs use_engram=True.")
        layer_index = _Range(True, 0, self.num_hidden_layers, excluded="hi")
        for name in ("engram_fusion_layers", "moe_layers"):
            layers = getattr(self, name)
            bad = [i for i in layers if not layer_index.admits(i)]
            if bad:
                fail(f"{name} has layer indices {bad} outside [0, {self.num_hidden_layers - 1}].")
            if len(set(layers)) != len(layers):
                fail(f"{name} has repeated layer indices: {layers}.")
        if self.scoring_func not in ("sqrtsoftplus", "softmax"):
            fail(f"scoring_func must be 'sqrtsoftplus' or 'softmax', got {self.scoring_func!r}.")
        if self.use_moe and not self.num_experts_per_tok <= self.n_routed_experts:
            fail(f"num_experts_per_tok ({self.num_experts_per_tok}) must lie in [1, n_routed_experts="
                 f"{self.n_routed_experts}].")
        if self.use_moe and not self.moe_layers:
            fail("use_moe=True but moe_layers is empty: list the MoE layers, or set use_moe=False.")
        if (self.hc_sinkhorn_iters, float(self.hc_eps)) != (20, 1e-6):
            fail(f"hc_sinkhorn_iters={self.hc_sinkhorn_iters!r} / hc_eps={self.hc_eps!r}: only the defaults (20, 1e-6) "
                 "are accepted; the static Byrne Hyper-Connections have no Sinkhorn projection to apply them to.")
        if self.use_elo and self.use_derf:
            logger.warning("SpikeWhaleConfig: use_elo=True and use_derf=True - Elo attention takes precedence "
                           "(config.py rule): the DERF parameters are not built and DERF is not applied.")
        if self.use_engram and 1.0 + math.erf(self.engram_gate_init_bias) < 2.0**-25:  # erf rounds to -1 in float32
            fail(f"engram_gate_init_bias={self.engram_gate_init_bias}: erf() of it rounds to -1 in float32, so the "
                 "Engram gate is a hard zero and it and the n-gram tables never train. Keep it >= about -2.5 "
                 "(released: -1.0).")
        if self.hrm_deep_supervision and not self.use_hrm_refine:
            fail("hrm_deep_supervision=True requires use_hrm_refine=True (it supervises the refinement steps); set "
                 "hrm_deep_supervision=False as well when turning use_hrm_refine off.")

    @property
    def loop_plan(self) -> LoopPlan:
        return LoopPlan.from_config(self)

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """transformers' tensor-parallel plan of the modules this config builds, in styles this transformers registers.
        Replicated: the low-rank latents (normed over their full width), norms, scalars, the router, the Memory-Cache
        branch (its packed qkv has no three-way style) and Engram fusion. No pipeline plan: passes re-enter layer 0."""
        styles, plan = registered_tp_styles(), {}
        per_head = ("elo_gain", "elo_k") if self.use_elo else ()
        per_head = per_head or (("derf_alpha", "derf_bias", "derf_gamma") if self.use_derf else ())
        if not per_head or "local_params" in styles:
            attn = {"q_b_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_a_proj": "rowwise"}
            plan.update({f"layers.*.attn.{name}": style for name, style in attn.items()})
            # One weight shared by the heads: each rank's gradient covers only its heads (TP training, 5.24+).
            if self.use_qk_norm and "replicated_with_grad_allreduce" in styles:
                plan["layers.*.attn.q_norm"] = plan["layers.*.attn.k_norm"] = "replicated_with_grad_allreduce"
            if per_head:
                plan["layers.*.attn"] = "local_params"
                plan.update({f"layers.*.attn.{name}": "colwise" for name in per_head})
        swiglu = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
        moe_layers = set(self.moe_layers) if self.use_moe else set()
        ffns = ["layers.*.ffn"] if len(moe_layers) < self.num_hidden_layers else []
        if moe_layers:
            ffns += ["layers.*.ffn.experts.*"] + (["layers.*.ffn.shared_experts"] if self.n_shared_experts else [])
        plan.update({f"{ffn}.{name}": style for ffn in ffns for name, style in swiglu.items()})
        if self.use_engram:
            if "embedding_rowwise" in styles:
                plan["engram.lookup.tables.*"] = "embedding_rowwise"
            plan["engram.gate.proj"] = "colwise_rep"
        if self.use_hrm_refine:
            plan.update({"hrm_refine.down": "colwise", "hrm_refine.up": "rowwise"})
        return {**plan, **self.__dict__.get("base_model_tp_plan", {})}

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str] | None) -> None:
        """transformers 5.15-5.20's `__post_init__` assigns the plan: rules the computed plan lacks are kept on top."""
        self.__dict__.pop("base_model_tp_plan", None)
        computed = self.base_model_tp_plan
        self.__dict__["base_model_tp_plan"] = {k: v for k, v in (plan or {}).items() if computed.get(k) != v}

    @property
    def num_loop_slots(self) -> int:
        """Number of cache slots: one per (layer, pass) entry of the loop plan (48 for Byrne-100M)."""
        return len(self.loop_plan)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "SpikeWhaleConfig":
        """A config from a named preset (`PRESETS`), with field overrides."""
        if name not in PRESETS:
            raise ValueError(f"Unknown SpikeWhale preset {name!r}; choose one of {sorted(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})


# Config field -> (checkpoint name regex, dimension or None: count the distinct numbers, the flag that builds it).
SIZE_FIELDS: dict[str, tuple[str, int | None, str | None]] = {
    "num_hidden_layers": (r"model\.layers\.(\d+)\.", None, None),
    "n_routed_experts": (r"\.ffn\.experts\.(\d+)\.", None, "use_moe"),
    "num_nextn_predict_layers": (r"mtp_heads\.(\d+)\.", None, None),
    "engram_num_heads": (r"model\.engram\.lookup\.tables\.(\d+)\.", None, "use_engram"),
    "engram_max_ngram": (r"model\.engram\.lookup\.hash_proj_n(\d+)_p", None, "use_engram"),
    "vocab_size": (r"model\.embed_tokens\.weight", 0, None), "hidden_size": (r"model\.embed_tokens\.weight", 1, None),
    "max_position_embeddings": (r"model\.layers\.\d+\.attn\.rope\.cos_cache", 0, None),
    "moe_intermediate_size": (r"model\.layers\.\d+\.ffn\.(experts\.\d+\.)?gate_proj\.weight", 0, None),
    "q_lora_rank": (r"model\.layers\.\d+\.attn\.q_a_proj\.weight", 0, None),
    "o_lora_rank": (r"model\.layers\.\d+\.attn\.o_a_proj\.weight", 0, None),
    "engram_table_size": (r"model\.engram\.lookup\.tables\.\d+\.weight", 0, "use_engram"),
    "hrm_refine_dim": (r"model\.hrm_refine\.down\.weight", 0, "use_hrm_refine"),
}


def refuse_oversized_config(args: tuple, kwargs: dict) -> None:
    """Refuse a config (config.json, `config=` or field kwargs of `from_pretrained(*args, **kwargs)`) asking for over
    4× what a local folder's safetensors hold in a `SIZE_FIELDS` field, before even a meta model is built."""
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    if source is None:
        return
    folder = os.path.join(str(source), *([kwargs["subfolder"]] if kwargs.get("subfolder") else []))
    if not os.path.isdir(folder):
        return
    shapes = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as handle:
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    if not shapes:
        return
    config = kwargs.get("config")
    names = {*SIZE_FIELDS, *(flag for _, _, flag in SIZE_FIELDS.values() if flag is not None)}
    if isinstance(config, SpikeWhaleConfig):
        values = {name: getattr(config, name, None) for name in names}
    else:
        path = config if isinstance(config, (str, os.PathLike)) else os.path.join(folder, "config.json")
        try:
            with open(os.path.join(path, "config.json") if os.path.isdir(path) else path) as f:
                values = json.load(f)
        except (OSError, ValueError):
            return  # transformers reports a missing or unreadable config itself
        if not isinstance(values, dict):
            return
        values.update({k: v for k, v in kwargs.items() if k in names})
    found = []
    for name, (pattern, dim, flag) in SIZE_FIELDS.items():
        value = values.get(name)
        if not isinstance(value, int) or (flag is not None and not values.get(flag, True)):
            continue
        matches = [(m, shape) for key, shape in shapes.items() if (m := re.search(pattern, key)) is not None]
        if dim is None:
            held = len({m.group(1) for m, _ in matches})
        elif matches:
            held = max(shape[dim] if len(shape) > dim else 0 for _, shape in matches)
        else:
            continue
        if value > 4 * max(held, 1):
            found.append(f"{name}={value} (the weights hold {held})")
    if found:
        raise ValueError(f"{folder}: the config asks for {', '.join(found)}, far more than its safetensors weights "
                         "hold; fix these fields in config.json (or pass the checkpoint's own config) to load it.")
