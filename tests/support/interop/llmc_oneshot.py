"""Run LLM Compressor's oneshot with a kvcal overlay's recipe and samples; print the K/V scales.

Runs in LLM Compressor's own environment (scripts/setup-llmcompressor), so it imports nothing
of kvcanary. argv: MODEL_DIR OVERLAY_DIR OUT_JSON; writes name -> scale(s) to OUT_JSON
(stdout is LLM Compressor's log).
"""

import json
import sys
from pathlib import Path

import torch
from datasets import load_dataset
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    model_dir, overlay, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    # oneshot's own dataset_path loader collects only files ending in "json", so not
    # samples.jsonl: the json loader of datasets reads it
    ds = load_dataset("json", data_files=str(overlay / "samples.jsonl"), split="train")
    ds = ds.select_columns(["input_ids"])
    ds = ds.map(lambda row: {"attention_mask": [1] * len(row["input_ids"])})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    oneshot(
        model=model,
        processor=AutoTokenizer.from_pretrained(model_dir),
        dataset=ds,
        recipe=str(overlay / "recipe.yaml"),
        num_calibration_samples=len(ds),
        max_seq_length=max(len(r) for r in ds["input_ids"]),
        shuffle_calibration_samples=False,
    )
    scales = {
        name: param.detach().float().flatten().tolist()
        for name, param in model.named_parameters()
        if name.endswith(("k_scale", "v_scale"))
    }
    out.write_text(json.dumps(scales))


if __name__ == "__main__":
    main()
