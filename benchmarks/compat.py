"""Which architectures plan, fit and train exactly: one plan each at the smallest peak any plan reaches.

    python -m benchmarks.compat [--threads 1] [--calibration-seconds 1] [--autocast none|bf16|fp16]
                                [--out benchmarks/COMPAT.md] [names...]

Each model is built small from its config (Hugging Face ``transformers``, random weights) or written here in plain
PyTorch (LSTM, ``nn.TransformerEncoder``, a GroupNorm U-Net, message passing, ...), in training mode with its
dropout. It is planned (``profile_repeats=1``, ``--calibration-seconds`` 1 a group: this checks memory and exactness,
not speed) for the smallest peak any plan reaches, as the ``InfeasibleBudgetError`` of a one-byte budget names it, and
one step of the planned module is measured with the live-storage meter. The table gives, per model, how it was
captured (whole, or in parts where export stops at data-dependent control flow), the budget, measured and
predicted peaks, and how far its gradients, loss and buffers lie from eager training (the model called as the user
calls it) and from its captured graph run without checkpoints. A plan in parts has no single prediction.

Where the captured graph is not eager's bit for bit, the model itself computes otherwise than the graph, and the
plan still reproduces the graph:

* GPT-Neo: called with its config's ``use_cache=True``, it concatenates each layer's keys onto an empty cache and
  multiplies the copy; the planned module runs it with ``use_cache=False`` (as ``gradient_checkpointing_enable``
  does), whose gradients are the graph's bit for bit.
* Falcon: it always builds its causal mask (``allow_is_causal_skip=False``), and capture hands the kernel
  ``is_causal=True`` instead of the constant mask (:mod:`planner.attention`); the CPU kernel sums in another order.

Under ``--autocast``, the planned module runs with autocast's cache of weight casts off
(:func:`planner.capture.casts_uncached`), so a weight read more than once a step is cast at each read, where eager
casts it once: its gradient is summed in another order (ALBERT's shared layer, a GRU's weights at every time step),
and lies apart from eager's, which this report runs with the cache on, as a user's loop does (the captured graph
runs without it, as the planned module does). Eager run without the cache
(``torch.autocast(..., cache_enabled=False)``) trains like the plan bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import sys
import time
import warnings
from typing import Any, Callable, Iterable

import numpy
import torch
import torch.nn as nn

import planner.api
from benchmarks.run import machine
from planner.capture import casts_uncached
from planner.meter import measure_step_peak


@dataclasses.dataclass(frozen=True)
class Case:
    """A model to build and the keyword inputs of one training step; its forward returns the loss (or an output
    with ``.loss``)."""

    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, Any]]


def _hf(config: str, model: str, **fields: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers
        return getattr(transformers, model)(getattr(transformers, config)(**fields))
    return build


def _tokens(**extra: Callable[[], torch.Tensor]) -> Callable[[], dict[str, Any]]:
    def inputs() -> dict[str, Any]:
        ids = torch.randint(0, 64, (4, 64))
        return {"input_ids": ids, "labels": ids, **{k: v() for k, v in extra.items()}}
    return inputs


def _seq2seq() -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 64, (4, 64)), "labels": torch.randint(0, 64, (4, 48))}


def _classes() -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 64, (4, 64)), "labels": torch.randint(0, 2, (4,))}


def _pixels() -> dict[str, Any]:
    return {"pixel_values": torch.randn(8, 3, 32, 32), "labels": torch.randint(0, 10, (8,))}


_DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)


def _lora(config: str, model: str, **fields: Any) -> Callable[[], nn.Module]:
    """A PEFT LoRA model (rank 8 on the attention's query and value projections, dropout 0.1) over ``_hf``'s."""
    def build() -> nn.Module:
        import peft
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
        return peft.get_peft_model(_hf(config, model, **fields)(), lora)
    return build
_ENCODER_DECODER = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)


# --- plain PyTorch -------------------------------------------------------------------------------------------

class LSTMLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=3, batch_first=True, dropout=0.1)
        self.head = nn.Linear(128, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.lstm(self.embed(ids))[0])
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class ResidualGRUs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.GRU(64, 64, batch_first=True) for _ in range(4))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)[0]
        return self.head(x).pow(2).mean()


class TorchEncoder(nn.Module):
    def __init__(self, norm_first: bool = False, causal: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True, norm_first=norm_first)
        self.encoder, self.causal, self.head = nn.TransformerEncoder(layer, 4), causal, nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if self.causal else None
        return self.head(self.encoder(x, mask=mask, is_causal=self.causal)).pow(2).mean()


class MultiheadAttentionStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attentions = nn.ModuleList(nn.MultiheadAttention(64, 4, dropout=0.1, batch_first=True) for _ in range(4))
        self.norms = nn.ModuleList(nn.LayerNorm(64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attention, norm in zip(self.attentions, self.norms):
            h = norm(x)
            x = x + attention(h, h, h, need_weights=False)[0]
        return x.pow(2).mean()


class TorchTransformer(nn.Module):
    """``nn.Transformer``: its decoder checks whether the target mask is causal by value, so it plans in parts."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Transformer(64, 4, 2, 2, 128, dropout=0.1, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.transformer(src, tgt, tgt_mask=mask).pow(2).mean()


def _conv_block(channels_in: int, channels_out: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.GroupNorm(8, channels_out), nn.SiLU(),
                         nn.Conv2d(channels_out, channels_out, 3, padding=1), nn.GroupNorm(8, channels_out), nn.SiLU())


class DiffusionUNet(nn.Module):
    """A denoiser's U-Net: GroupNorm, SiLU, a timestep embedding added in the middle, skips across."""

    def __init__(self) -> None:
        super().__init__()
        self.down1, self.down2, self.middle = _conv_block(3, 32), _conv_block(32, 64), _conv_block(64, 64)
        self.up2, self.up1 = _conv_block(128, 32), _conv_block(64, 32)
        self.time = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 64))
        self.out = nn.Conv2d(32, 3, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        pool, up = nn.functional.avg_pool2d, nn.functional.interpolate
        a = self.down1(x)
        b = self.down2(pool(a, 2))
        m = self.middle(pool(b, 2)) + self.time(t)[:, :, None, None]
        u = self.up2(torch.cat([up(m, scale_factor=2), b], 1))
        u = self.up1(torch.cat([up(u, scale_factor=2), a], 1))
        return (self.out(u) - x).pow(2).mean()


class MessagePassing(nn.Module):
    """Graph convolutions: gather along edges, scatter-add into nodes (``index_add``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(torch.zeros_like(x).index_add(0, target, layer(x)[source])) + x
        return x.pow(2).mean()


class BagOfEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1000, 64, mode="mean")
        self.mlp = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(3)])

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids, offsets)).pow(2).mean()


class AudioConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Conv1d(32, 32, 5, padding=2), nn.BatchNorm1d(32), nn.ReLU(),
                                                 nn.Dropout(0.1)) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def _edges() -> dict[str, Any]:
    return {"x": torch.randn(2048, 64), "source": torch.randint(0, 2048, (8192,)),
            "target": torch.randint(0, 2048, (8192,))}


CASES: dict[str, Case] = {
    "qwen2": Case("transformers", _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_DECODER),
                  _tokens()),
    "qwen2_moe": Case("transformers", _hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2,
                                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=32, **_DECODER), _tokens()),
    "qwen3": Case("transformers", _hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8,
                                      **_DECODER), _tokens()),
    "phi3": Case("transformers", _hf("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, pad_token_id=0,
                                     **_DECODER), _tokens()),
    "phi": Case("transformers", _hf("PhiConfig", "PhiForCausalLM", **_DECODER), _tokens()),
    "gemma": Case("transformers", _hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8,
                                      **_DECODER), _tokens()),
    "gemma2": Case("transformers", _hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=8,
                                       **_DECODER), _tokens()),
    "gpt_neox": Case("transformers", _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **_DECODER), _tokens()),
    "falcon": Case("transformers", _hf("FalconConfig", "FalconForCausalLM", vocab_size=64, hidden_size=32,
                                       num_hidden_layers=3, num_attention_heads=4), _tokens()),
    "opt": Case("transformers", _hf("OPTConfig", "OPTForCausalLM", vocab_size=64, hidden_size=32, ffn_dim=64,
                                    num_hidden_layers=3, num_attention_heads=4, word_embed_proj_dim=32), _tokens()),
    "bloom": Case("transformers", _hf("BloomConfig", "BloomForCausalLM", vocab_size=64, hidden_size=32, n_layer=3,
                                      n_head=4), _tokens()),
    "gptj": Case("transformers", _hf("GPTJConfig", "GPTJForCausalLM", vocab_size=64, n_embd=32, n_layer=3, n_head=4,
                                     rotary_dim=4), _tokens()),
    "gpt_neo": Case("transformers", _hf("GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=64, hidden_size=32,
                                        num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                                        max_position_embeddings=64), _tokens()),
    "starcoder2": Case("transformers", _hf("Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=2,
                                           **_DECODER), _tokens()),
    "olmo": Case("transformers", _hf("OlmoConfig", "OlmoForCausalLM", num_key_value_heads=2, **_DECODER), _tokens()),
    "granite": Case("transformers", _hf("GraniteConfig", "GraniteForCausalLM", num_key_value_heads=2, **_DECODER),
                    _tokens()),
    "mamba": Case("transformers", _hf("MambaConfig", "MambaForCausalLM", vocab_size=64, hidden_size=32,
                                      num_hidden_layers=2, state_size=8), _tokens()),
    "llama_lora": Case("peft", _lora("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_DECODER),
                       _tokens()),
    "segformer": Case("transformers", _hf("SegformerConfig", "SegformerForSemanticSegmentation", num_encoder_blocks=2,
                                          depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                          num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=4),
                      lambda: {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 4, (4, 32, 32))}),
    "roberta": Case("transformers", _hf("RobertaConfig", "RobertaForSequenceClassification",
                                        max_position_embeddings=80, **_DECODER), _classes),
    "distilbert": Case("transformers", _hf("DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=64,
                                           dim=32, hidden_dim=64, n_layers=3, n_heads=4), _classes),
    "deberta_v2": Case("transformers", _hf("DebertaV2Config", "DebertaV2ForSequenceClassification", **_DECODER),
                       _classes),
    "electra": Case("transformers", _hf("ElectraConfig", "ElectraForSequenceClassification", embedding_size=32,
                                        **_DECODER), _classes),
    "albert": Case("transformers", _hf("AlbertConfig", "AlbertForSequenceClassification", embedding_size=16,
                                       **_DECODER), _classes),
    "modernbert": Case("transformers", _hf("ModernBertConfig", "ModernBertForSequenceClassification", vocab_size=64,
                                           hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                           cls_token_id=1, sep_token_id=2), _classes),
    "mbart": Case("transformers", _hf("MBartConfig", "MBartForConditionalGeneration", max_position_embeddings=64,
                                      **_ENCODER_DECODER), _seq2seq),
    "pegasus": Case("transformers", _hf("PegasusConfig", "PegasusForConditionalGeneration",
                                        max_position_embeddings=64, **_ENCODER_DECODER), _seq2seq),
    "whisper": Case("transformers", _hf("WhisperConfig", "WhisperForConditionalGeneration", num_mel_bins=8,
                                        max_source_positions=32, max_target_positions=64, decoder_start_token_id=1,
                                        pad_token_id=0, **_ENCODER_DECODER),
                    lambda: {"input_features": torch.randn(4, 8, 64), "labels": torch.randint(0, 64, (4, 48))}),
    "wav2vec2": Case("transformers", _hf("Wav2Vec2Config", "Wav2Vec2ForCTC", vocab_size=32, hidden_size=32,
                                         num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                                         conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4),
                     lambda: {"input_values": torch.randn(2, 8000), "labels": torch.randint(1, 32, (2, 10))}),
    "swin": Case("transformers", _hf("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=2,
                                     embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=10),
                 _pixels),
    "convnext": Case("transformers", _hf("ConvNextConfig", "ConvNextForImageClassification",
                                         hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10), _pixels),
    "resnet_hf": Case("transformers", _hf("ResNetConfig", "ResNetForImageClassification",
                                          hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], embedding_size=8,
                                          num_labels=10), _pixels),
    "deit": Case("transformers", _hf("DeiTConfig", "DeiTForImageClassification", hidden_size=32, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=4,
                                     num_labels=10), _pixels),
    "lstm": Case("torch", LSTMLanguageModel, lambda: {"ids": torch.randint(0, 100, (16, 64))}),
    "gru": Case("torch", ResidualGRUs, lambda: {"x": torch.randn(16, 64, 64)}),
    "encoder": Case("torch", TorchEncoder, lambda: {"x": torch.randn(16, 64, 64)}),
    "encoder_prenorm": Case("torch", lambda: TorchEncoder(norm_first=True), lambda: {"x": torch.randn(16, 64, 64)}),
    "encoder_causal": Case("torch", lambda: TorchEncoder(causal=True), lambda: {"x": torch.randn(16, 64, 64)}),
    "multihead_attention": Case("torch", MultiheadAttentionStack, lambda: {"x": torch.randn(16, 64, 64)}),
    "transformer": Case("torch", TorchTransformer,
                        lambda: {"src": torch.randn(8, 32, 64), "tgt": torch.randn(8, 32, 64)}),
    "diffusion_unet": Case("torch", DiffusionUNet, lambda: {"x": torch.randn(4, 3, 32, 32), "t": torch.randn(4, 16)}),
    "message_passing": Case("torch", MessagePassing, _edges),
    "embedding_bag": Case("torch", BagOfEmbeddings, lambda: {"ids": torch.randint(0, 1000, (4096,)),
                                                             "offsets": torch.arange(0, 4096, 16)}),
    "audio_convs": Case("torch", AudioConvs, lambda: {"x": torch.randn(16, 32, 256)}),
}


_AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Step:
    """One measured training step: loss, gradients and buffers after it, and its peak (live storages, with the
    parameters, buffers and inputs)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    peak_bytes: int


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output["loss"]


def measured_step(run: Callable[[], Any], model: nn.Module, inputs: Iterable[Any], *, seed: int = 0) -> Step:
    """``run()``'s loss (the output, or its ``loss``), backward, under the meter, from ``seed`` (torch's, Python's
    and NumPy's generators: wav2vec2's SpecAugment draws its masks from NumPy); the peak counts
    ``model``'s parameters and buffers and the tensors among ``inputs``, the gradients and buffers are ``model``'s,
    and its buffers are put back after (``tests/helpers.training_step`` measures the tests' steps with it)."""
    before = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []

    def step() -> None:
        loss = _loss(run())
        loss.backward()  # outside autocast, as PyTorch recommends
        losses.append(loss.detach())
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)
    peak = measure_step_peak(step, model.parameters(), model.buffers(),
                             [x for x in inputs if isinstance(x, torch.Tensor)])
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(before[name])
    model.zero_grad(set_to_none=True)
    return Step(losses[0], grads, buffers, peak)


def distance(a: Step, b: Step) -> float:
    """The largest absolute difference between the two steps' losses, gradients and buffers (inf when they hold
    different gradients or buffers)."""
    if a.grads.keys() != b.grads.keys() or a.buffers.keys() != b.buffers.keys():
        return float("inf")
    pairs = [(a.loss, b.loss), *((a.grads[k], b.grads[k]) for k in a.grads),
             *((a.buffers[k], b.buffers[k]) for k in a.buffers)]
    return max((x.double() - y.double()).abs().max().item() if x.numel() else 0.0 for x, y in pairs)


@dataclasses.dataclass(frozen=True)
class Row:
    """One model of the report: how it was captured and planned, its peaks (bytes), and how far its planned step
    lies from eager's and from its graph's (:func:`distance`; None where planned in parts); ``error`` when it could
    not be checked."""

    name: str
    family: str
    parts: bool
    regions: int | None
    eager_bytes: int
    budget_bytes: int
    measured_bytes: int
    predicted_bytes: int | None
    from_eager: float
    from_graph: float | None
    planning_seconds: float
    error: str | None = None


class EagerFailed(Exception):
    """The model's own step fails, unplanned (a model that does not run under autocast): nothing to plan."""


def _autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def check(name: str, autocast: torch.dtype | None = None) -> Row:
    """Plan ``CASES[name]`` at its smallest peak, measure a step, compare it with eager and with the graph; with
    ``autocast``, every forward (and the planning) runs under ``torch.autocast("cpu", dtype=autocast)``."""
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().train()
    inputs = case.inputs()

    def forward(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with _autocast(autocast):
                return call()
        return run
    try:
        eager = measured_step(forward(lambda: model(**inputs)), model, inputs.values())
    except Exception as exc:
        raise EagerFailed(f"{type(exc).__name__}: {exc}") from exc
    options = dict(example_kwargs=inputs, profile_repeats=1, hold_outputs=False, loss_fn=_loss)
    started = time.perf_counter()
    with _autocast(autocast):
        try:
            planner.optimize(model, 1, **options)
            raise AssertionError("a one-byte budget was found feasible")
        except planner.InfeasibleBudgetError as error:
            budget = error.minimum_budget_bytes
        optimized = planner.optimize(model, budget, **options)
    seconds = time.perf_counter() - started
    planned = measured_step(forward(lambda: optimized(**inputs)), model, inputs.values())
    if optimized.parts:
        return Row(name, case.family, True, None, eager.peak_bytes, budget, planned.peak_bytes, None,
                   distance(eager, planned), None, seconds)
    captured = optimized.planned.captured

    def run_graph() -> Any:
        with casts_uncached():  # as the planned module runs it
            return captured.graph_module(*captured.example_args, **captured.example_kwargs)
    graph = measured_step(forward(run_graph), model, inputs.values())
    return Row(name, case.family, False, len(optimized.plan.regions), eager.peak_bytes, budget, planned.peak_bytes,
               optimized.plan.predicted_peak_bytes, distance(eager, planned), distance(graph, planned), seconds)


def _apart(value: float | None) -> str:
    if value is None:
        return "-"
    return "bit for bit" if value == 0 else f"{value:.1e} apart"


def table(rows: list[Row]) -> str:
    lines = ["| model | family | captured | eager peak | budget (smallest peak) | measured | predicted "
             "| vs eager | vs captured graph | planning |", "|---" * 10 + "|"]
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.name} | {r.family} | failed: {r.error} |" + " |" * 7)
            continue
        fits = "fits" if r.measured_bytes <= r.budget_bytes else "OVER"
        predicted = "-" if r.predicted_bytes is None else \
            f"{r.predicted_bytes:,} ({(r.predicted_bytes - r.measured_bytes) / r.measured_bytes:+.2%})"
        captured = "in parts" if r.parts else f"whole, {r.regions} region(s)"
        lines.append(f"| {r.name} | {r.family} | {captured} | {r.eager_bytes:,} | {r.budget_bytes:,} "
                     f"| {r.measured_bytes:,} ({fits}) | {predicted} | {_apart(r.from_eager)} "
                     f"| {_apart(r.from_graph)} | {r.planning_seconds:.0f} s |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    ran = [r for r in rows if r.error is None]
    fit = sum(r.measured_bytes <= r.budget_bytes for r in ran)
    predicted = [r for r in ran if r.predicted_bytes is not None]
    within = sum(abs(r.predicted_bytes - r.measured_bytes) <= 0.03 * r.measured_bytes for r in predicted)
    exact_graph = sum(r.from_graph == 0 for r in predicted)
    exact_eager = sum(r.from_eager == 0 for r in ran)
    return (f"{len(ran)} of {len(rows)} planned; {fit} fit their budget; {within} of {len(predicted)} predictions "
            f"within 3%; {exact_graph} of {len(predicted)} train like their captured graph bit for bit; "
            f"{exact_eager} of {len(ran)} like eager bit for bit.")


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models to check (default all: {', '.join(CASES)})")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calibration-seconds", type=float, default=1.0,
                        help="the most seconds each group of calibration steps is timed (the planner's default: 30)")
    parser.add_argument("--autocast", choices=sorted(_AUTOCAST), default="none",
                        help="run every forward, and the planning, under torch.autocast('cpu', dtype=...)")
    parser.add_argument("--out", help="also write the report to this Markdown file")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in CASES]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(CASES)}")
    rows = []
    threads, calibration = torch.get_num_threads(), planner.api.CALIBRATION_SECONDS
    torch.set_num_threads(args.threads)
    planner.api.CALIBRATION_SECONDS = args.calibration_seconds
    described = machine()  # with the threads it runs on
    try:
        for name in args.names or list(CASES):
            rows.append(_checked(name, _AUTOCAST[args.autocast]))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads)
        planner.api.CALIBRATION_SECONDS = calibration
    command = " ".join(["python -m benchmarks.compat", *(argv if argv is not None else sys.argv[1:])])
    precision = "" if args.autocast == "none" else f", under autocast ({args.autocast})"
    report = (f"# Architectures at their smallest peak{precision}\n\nMachine: {described}. Command: `{command}`.\n\n"
              f"{table(rows)}\n\n{summary(rows)}\n")
    print(report)
    if args.out:
        with open(args.out, "w") as out:
            out.write(report)
    return rows


def _checked(name: str, autocast: torch.dtype | None) -> Row:
    """:func:`check`, or a row naming what failed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return check(name, autocast)
        except Exception as exc:  # a model that fails is a row of the report, not the end of it
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            what = f"eager step failed, {text}" if isinstance(exc, EagerFailed) else f"{type(exc).__name__}: {text}"
            return Row(name, CASES[name].family, False, None, 0, 0, 0, None, float("nan"), None, 0.0,
                       error=what[:200])


if __name__ == "__main__":
    main()
