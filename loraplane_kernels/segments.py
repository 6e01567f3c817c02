"""The value that describes SGMV (prefill) grouping of tokens by adapter slot.

Prefill batches are made of whole sequences, and every token of one sequence uses the same
adapter. Describing the batch as contiguous segments lets a kernel load one adapter's weights
once per tile of tokens instead of once per token, which is what makes prefill compute-bound
rather than weight-bandwidth-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segments:
    """Tokens ``starts[g]:starts[g+1]`` all use slot ``slots[g]`` (``-1`` means no LoRA).

    ``starts`` is non-decreasing with ``starts[0] == 0`` and ``starts[-1] == T``; a segment
    may be empty. Both tensors are int32 and live on the same device as the activations.
    """

    starts: Tensor
    slots: Tensor

    @property
    def num_segments(self) -> int:
        return int(self.slots.shape[0])

    def token_indices(self) -> Tensor:
        """Expand to one slot index per token (BGMV form).

        Used by the torch path, which groups tokens by slot anyway, so one code path serves
        both families there.
        """
        lengths = (self.starts[1:] - self.starts[:-1]).to(torch.int64)
        return torch.repeat_interleave(self.slots.to(torch.int32), lengths)

    @staticmethod
    def from_lengths(lengths: list[int], slots: list[int], device: torch.device | str = "cpu"
                     ) -> Segments:
        """Build segments from per-sequence lengths, the form a scheduler naturally has."""
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        return Segments(
            starts=torch.tensor(starts, dtype=torch.int32, device=device),
            slots=torch.tensor(slots, dtype=torch.int32, device=device),
        )
