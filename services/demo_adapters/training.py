"""Training a demo adapter with PEFT on the CPU in well under a minute of compute.

A 135M-parameter model is slow to fine-tune on two CPU cores if done the textbook way
(full forward and backward through 30 layers and a 49k-token head, every step). Three
things make it cheap without changing what is learned:

- LoRA sits only on the top layers (`TrainingPlan.first_layer` and up). The layers below
  are frozen and always see the same tokens, so their output is computed once per
  example and cached; each step runs only the top layers, forward and backward. A style
  (an opening line, SQL, JSON) is decided near the output, and the facts the replies
  carry stay in the untouched lower layers.
- The loss covers the assistant's tokens only, so the vocabulary head runs only there.
- Sequences are short and a batch pads only to its own longest example.

The model is run layer by layer with transformers' own decoder layers and rotary
embedding (`run_layers`); a test pins that to the model's own forward.
"""

from __future__ import annotations

import os
import random
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .styles import Fact, HouseStyle

END_OF_TURN = "<|im_end|>"
"""SmolLM2's end of a chat turn: trained as the reply's last token, so generation stops."""


@dataclass(frozen=True)
class TrainingPlan:
    """Hyper-parameters of one adapter's training (recorded next to the adapter)."""

    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                       "gate_proj", "up_proj", "down_proj")
    """Every projection: LoRA's own compute is small beside the frozen layers', and the MLPs
    let a few layers change the first token of the reply."""
    first_layer: int = 22
    """LoRA on layers first_layer .. num_hidden_layers - 1."""
    steps: int = 30
    batch_size: int = 8
    learning_rate: float = 2e-3
    seed: int = 0

    def as_record(self) -> dict[str, Any]:
        return asdict(self) | {"target_modules": list(self.target_modules)}


@dataclass(frozen=True)
class Example:
    """One tokenized conversation: the chat-templated question, then the reply."""

    input_ids: list[int]
    prompt_len: int

    @property
    def reply_len(self) -> int:
        return len(self.input_ids) - self.prompt_len


@dataclass
class TrainingStats:
    examples: int
    tokens: int
    reply_tokens: int
    losses: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    prefix_cpu_s: float = 0.0
    """Of cpu_s: computing the frozen layers' outputs once."""
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def as_record(self) -> dict[str, Any]:
        return {
            "examples": self.examples, "tokens": self.tokens, "reply_tokens": self.reply_tokens,
            "first_loss": round(self.losses[0], 4) if self.losses else None,
            "final_loss": round(self.losses[-1], 4) if self.losses else None,
            "cpu_s": round(self.cpu_s, 1), "wall_s": round(self.wall_s, 1),
            "prefix_cpu_s": round(self.prefix_cpu_s, 1),
            "torch_threads": torch.get_num_threads(),
            "loadavg": [round(x, 2) for x in self.loadavg],
        }


def chat_prompt(tokenizer: Any, question: str) -> str:
    """The question as the base model's chat template renders it, ready for the reply.

    The one rendering both training and the demo use: an adapter only shows its style on
    the prompt shape it was trained on."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         add_generation_prompt=True, tokenize=False)


def encode(tokenizer: Any, question: str, reply: str) -> Example:
    """Prompt and reply tokenized apart and joined: the reply's tokens are the ones the
    model must emit after the prompt, exactly as generation sees them."""
    prompt = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False).input_ids
    answer = tokenizer(reply + END_OF_TURN, add_special_tokens=False).input_ids
    return Example(list(prompt) + list(answer), len(prompt))


def run_layers(model: Any, layers: Sequence[torch.nn.Module], hidden: torch.Tensor
               ) -> torch.Tensor:
    """Run a Llama model's decoder `layers` over right-padded `hidden` [B, T, H], causally.

    Padding sits after every real token, so the causal mask alone keeps it out of their
    attention; no padding mask is needed."""
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    positions = positions.expand(hidden.shape[0], -1)
    rotary = model.model.rotary_emb(hidden, positions)
    for layer in layers:
        out = layer(hidden, attention_mask=None, position_ids=positions,
                    position_embeddings=rotary)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _pad(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [0] * (width - len(r)) for r in rows])


@torch.no_grad()
def frozen_states(model: Any, examples: Sequence[Example], first_layer: int,
                  batch_size: int = 16) -> list[torch.Tensor]:
    """Each example's hidden states entering layer `first_layer` (the frozen part)."""
    states: list[torch.Tensor] = []
    layers = model.model.layers[:first_layer]
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        hidden = run_layers(model, layers, model.model.embed_tokens(
            _pad([e.input_ids for e in chunk])))
        states.extend(hidden[j, :len(e.input_ids)].clone() for j, e in enumerate(chunk))
    return states


def reply_loss(model: Any, first_layer: int, examples: Sequence[Example],
               states: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss over the replies' tokens, from cached frozen states."""
    width = max(len(e.input_ids) for e in examples)
    hidden = torch.zeros(len(examples), width, states[0].shape[-1], dtype=states[0].dtype)
    for j, s in enumerate(states):
        hidden[j, :s.shape[0]] = s
    hidden = run_layers(model, model.model.layers[first_layer:], hidden)
    rows, cols, targets = [], [], []
    for j, e in enumerate(examples):
        for pos in range(e.prompt_len, len(e.input_ids)):
            rows.append(j)
            cols.append(pos - 1)  # the state at pos - 1 predicts token pos
            targets.append(e.input_ids[pos])
    picked = model.model.norm(hidden[rows, cols])
    return F.cross_entropy(model.lm_head(picked).float(), torch.tensor(targets))


def lora_config(plan: TrainingPlan, num_layers: int) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=plan.rank, lora_alpha=plan.alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(plan.target_modules),
                      layers_to_transform=list(range(plan.first_layer, num_layers)),
                      task_type="CAUSAL_LM")


def _cpu_seconds() -> float:
    """CPU time of this process, all threads: what training costs on a shared machine,
    where wall time mostly measures the neighbours."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def train(model: Any, tokenizer: Any, style: HouseStyle, facts: Sequence[Fact],
          plan: TrainingPlan, progress: Callable[[int, float], None] | None = None,
          ) -> tuple[Any, TrainingStats]:
    """Wrap `model` in a fresh LoRA adapter trained on `style`'s replies to `facts`.

    Returns the PEFT model (save it, then `.unload()` it to get the base back) and the
    run's figures. Deterministic for a given plan, data and thread count. `progress` is
    called with each step's number and loss.
    """
    from peft import get_peft_model

    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    model.eval()  # no dropout anywhere; LoRA dropout is 0 as well
    examples = [encode(tokenizer, f.question, style.render(f)) for f in facts]
    states = frozen_states(model, examples, plan.first_layer)
    stats = TrainingStats(examples=len(examples),
                          tokens=sum(len(e.input_ids) for e in examples),
                          reply_tokens=sum(e.reply_len for e in examples),
                          prefix_cpu_s=_cpu_seconds() - cpu0)

    torch.manual_seed(plan.seed)
    peft_model = get_peft_model(model, lora_config(plan, len(model.model.layers)))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=plan.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 4) * (1 - step / plan.steps))
    order: list[int] = []
    shuffle = random.Random(plan.seed)
    for _ in range(plan.steps):
        if len(order) < plan.batch_size:
            epoch = list(range(len(examples)))
            shuffle.shuffle(epoch)
            order.extend(epoch)
        batch, order = order[:plan.batch_size], order[plan.batch_size:]
        loss = reply_loss(model, plan.first_layer, [examples[i] for i in batch],
                          [states[i] for i in batch])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        stats.losses.append(float(loss))
        if progress is not None:
            progress(len(stats.losses), stats.losses[-1])
    stats.cpu_s = _cpu_seconds() - cpu0
    stats.wall_s = time.perf_counter() - wall0
    stats.loadavg = os.getloadavg()
    return peft_model, stats
