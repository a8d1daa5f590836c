"""The SNAC audio decoder: speech codes -> 24 kHz audio, chunk by chunk.

The architecture comes from the `snac` package; weights from a local
directory (config.json + model.safetensors or pytorch_model.bin). Two changes
make streaming exact:

- SNAC's decoder adds Gaussian noise (`NoiseBlock`) drawn fresh on every call.
  Here the noise is read from a fixed table at each sample's absolute position,
  so decoding a window of frames gives the same samples as decoding the whole
  utterance at once.
- A chunk is decoded with `lookback` frames before it and `lookahead` frames
  after it (when they exist) and only its own samples are kept. The decoder is
  convolutional with a receptive field of about +-3 frames, so with 3 or more
  frames of context a chunk's samples equal one-shot decoding up to float
  rounding (see tests/engine/test_speech.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.devices import SideStream
from engine.models.config import CheckpointError

from .layout import split_codebooks

NOISE_TABLE = 1 << 20
# Codebook strides of the 24 kHz SNAC, whose frame (1 + 2 + 4 codes) the layout writes.
SNAC_FRAME_STRIDES = (4, 2, 1)


@dataclass(frozen=True)
class DecodeWindow:
    """Frames [start, end) of one request's codes to decode; keep [keep_start, keep_end)."""

    codes: np.ndarray  # [end - start, 7]
    start: int
    keep_start: int
    keep_end: int


class SpeechCodec:
    """A SNAC decoder loaded from `codec_dir`, with position-indexed noise."""

    def __init__(self, codec_dir: str | Path, device: torch.device, dtype: torch.dtype = torch.float32,
                 lookback: int = 3, lookahead: int = 3):
        from snac import SNAC

        root = Path(codec_dir)
        config_path = root / "config.json"
        if not config_path.exists():
            raise CheckpointError(f"codec is missing config.json (looked in {root})")
        config = json.loads(config_path.read_text())
        try:
            model = SNAC(**config)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"codec config.json does not describe a SNAC model ({e})") from None
        # The speech layout's frame is the 24 kHz model's: 7 codes over three
        # codebooks (1, 2, 4 a frame). Another SNAC (32/44 kHz: four codebooks)
        # would load and then fail every request inside its decoder.
        if [int(s) for s in model.vq_strides] != list(SNAC_FRAME_STRIDES):
            raise CheckpointError(f"codec has codebook strides {list(model.vq_strides)}; the speech layout "
                                  f"needs {list(SNAC_FRAME_STRIDES)} (24 kHz SNAC: 7 codes a frame)")
        self.codebook_size = int(model.codebook_size)
        try:
            model.load_state_dict(_load_weights(root))
        except RuntimeError as e:  # missing, unexpected or misshapen weights
            raise CheckpointError(f"codec weights do not match its config.json: {str(e)[:300]}") from None
        _remove_weight_norm(model)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = device, dtype
        # Windows of one length decode as one batch (see `decode`).
        self.batch_windows = device.type == "cuda"
        self.sample_rate = int(config.get("sampling_rate", 24000))
        self.latents_per_frame = int(model.vq_strides[0])
        self.samples_per_frame = int(model.hop_length) * self.latents_per_frame
        self.lookback, self.lookahead = lookback, lookahead
        gen = torch.Generator().manual_seed(20240611)
        self._noise = torch.randn(NOISE_TABLE, generator=gen).to(device=device, dtype=dtype)
        self._noise_blocks = [m for m in self.model.modules() if type(m).__name__ == "NoiseBlock"]
        # Samples per latent step at each noise block's output (after its upsampling).
        rates = list(model.decoder_rates)
        self._block_scale = [math.prod(rates[: i + 1]) for i in range(len(self._noise_blocks))]
        self._offsets: torch.Tensor | None = None
        for i, block in enumerate(self._noise_blocks):
            block.forward = self._noise_forward(block, i)  # type: ignore[method-assign]
        self._use_fused_snake(device, dtype)
        # Its codes come from tokens already on the host: nothing orders it after the step in flight.
        self._stream = SideStream(device)

    def _use_fused_snake(self, device: torch.device, dtype: torch.dtype) -> None:
        """On CPU (fp32), run SNAC's snake activation as one vectorized kernel."""
        from engine.kernels import cpu_ops

        ops = cpu_ops() if device.type == "cpu" and dtype == torch.float32 else None
        if ops is None:
            return
        for module in self.model.modules():
            if type(module).__name__ == "Snake1d":
                alpha = module.alpha.detach().reshape(-1).contiguous()
                module.forward = (lambda a: lambda x: ops.snake(x, a))(alpha)  # type: ignore[method-assign]

    def _noise_forward(self, block, index: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            assert self._offsets is not None
            b, _, t = x.shape
            start = self._offsets * self._block_scale[index] + index * 7919
            idx = (start[:, None] + torch.arange(t, device=x.device)[None, :]) % NOISE_TABLE
            noise = self._noise[idx][:, None, :]
            return x + noise * block.linear(x)
        return forward

    @torch.inference_mode()
    def decode(self, windows: Sequence[DecodeWindow]) -> list[np.ndarray]:
        """Decode each window and return its kept samples (float32, mono).

        On CUDA, windows of the same length run as one batch. On CPU each runs
        alone: a batch's activations outgrow the caches, and 8 windows batched
        took 2.2x longer than one at a time on the 2-core machine.
        """
        with self._stream.active():
            return self._decode(windows)

    def _decode(self, windows: Sequence[DecodeWindow]) -> list[np.ndarray]:
        out: list[np.ndarray | None] = [None] * len(windows)
        groups: list[list[int]] = []
        if self.batch_windows:
            by_len: dict[int, list[int]] = {}
            for i, w in enumerate(windows):
                by_len.setdefault(len(w.codes), []).append(i)
            groups = [by_len[n] for n in sorted(by_len)]
        else:
            groups = [[i] for i in range(len(windows))]
        for idx in groups:
            books = [split_codebooks(windows[i].codes) for i in idx]
            codes = [torch.from_numpy(np.stack([b[k] for b in books])).to(self.device) for k in range(3)]
            self._offsets = torch.tensor([windows[i].start * self.latents_per_frame for i in idx],
                                         device=self.device)
            z = self.model.quantizer.from_codes(codes)
            audio = self.model.decoder(z.to(self.dtype)).float()[:, 0].cpu().numpy()
            for row, i in enumerate(idx):
                w = windows[i]
                a = (w.keep_start - w.start) * self.samples_per_frame
                b = (w.keep_end - w.start) * self.samples_per_frame
                out[i] = audio[row, a:b]
        self._offsets = None
        return [o for o in out if o is not None]

    def decode_all(self, codes: np.ndarray) -> np.ndarray:
        """One-shot decoding of a whole utterance (the reference for streaming)."""
        n = len(codes)
        return self.decode([DecodeWindow(codes, 0, 0, n)])[0]


def _load_weights(root: Path) -> dict[str, torch.Tensor]:
    if (root / "model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(str(root / "model.safetensors"))
    if (root / "pytorch_model.bin").exists():
        return torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(f"codec has no model.safetensors or pytorch_model.bin (looked in {root})")


def _remove_weight_norm(model: torch.nn.Module) -> None:
    """Fold weight-norm parametrizations into plain weights (no recompute per call)."""
    from torch.nn.utils import parametrize

    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


SNAC_24KHZ = {
    "sampling_rate": 24000, "encoder_dim": 48, "encoder_rates": [2, 4, 8, 8], "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2], "attn_window_size": None, "codebook_size": 4096, "codebook_dim": 8,
    "vq_strides": [4, 2, 1], "noise": True, "depthwise": True,
}


def write_random_codec(out_dir: str | Path, seed: int = 24, config: dict | None = None) -> Path:
    """A randomly initialised SNAC (24 kHz architecture by default), for demos and tests."""
    from safetensors.torch import save_file
    from snac import SNAC

    cfg = dict(config or SNAC_24KHZ)
    torch.manual_seed(seed)
    model = SNAC(**cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    return out
