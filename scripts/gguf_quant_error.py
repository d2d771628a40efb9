"""Logit error of each ``lmlab export --format gguf --quant`` on a run, on real text.

usage: python scripts/gguf_quant_error.py RUN TEXT.txt OUT_FOLDER [--rows 8 --len 128]

Exports RUN in every --quant into OUT_FOLDER, reads each file back with lmlab's GGUF loader and
prints one Markdown table row per quant: file bytes, max |logit diff| from the run's model,
that over max |logit|, the share of positions whose greedy next token is the model's, the
cross-entropy (nats/token) on the last 10% of TEXT (the validation split), and the same for the
file read with llama.cpp's tanh GELU (``lmlab_keys=False``). docs/gguf-export.md shows its output.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from lmlab.interop.gguf import load_gguf
from lmlab.interop.gguf_export import QUANTS, export_gguf
from lmlab.interop.load import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("text")
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--len", type=int, default=128)
    args = ap.parse_args()
    model, tok = load(args.run, "cpu")
    model = model.float().eval()
    text = Path(args.text).read_text(encoding="utf-8")
    ids = tok.encode(text[int(len(text) * 0.9) :])[: args.rows * args.len]
    x = torch.tensor(ids).view(args.rows, args.len)

    def score(m: torch.nn.Module) -> tuple[torch.Tensor, float]:
        with torch.no_grad():
            logits = m.eval()(x).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        return logits, float(loss)

    ref, loss = score(model)
    print(f"model: loss {loss:.4f} nats/token on {x.numel()} tokens of the validation text")
    print("| --quant | file bytes | max abs logit diff | relative | greedy equal | loss "
          "| llama.cpp's tanh GELU: max abs diff (loss) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for quant in QUANTS:
        res = export_gguf(args.run, Path(args.out) / f"model-{quant}.gguf", quant, force=True)
        logits, q_loss = score(load_gguf(res.out)[0])
        tanh_logits, tanh_loss = score(load_gguf(res.out, lmlab_keys=False)[0])
        diff = float((logits - ref).abs().max())
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        tanh_diff = float((tanh_logits - ref).abs().max())
        print(
            f"| {quant} | {res.n_bytes:,} | {diff:.1e} | {diff / float(ref.abs().max()):.1e} "
            f"| {agree:.1%} | {q_loss:.4f} | {tanh_diff:.1e} ({tanh_loss:.4f}) |"
        )


if __name__ == "__main__":
    main()
