"""Decoding and the pieces every decoding command shares, as a package.

- `decoding.py`: plan-and-infill (ReFusion) and AR decoding with one KV cache;
  its row programs in `plan_infill.py` and `left_to_right.py` (shared parts: `rows.py`), run
  by `driver.py`, reading the logits through `decisions.py`;
- `loading.py`: a Hugging Face folder or a training checkpoint loaded for inference, with its
  tokenizer, on the chosen device and dtype;
- `cli.py`: the decoding options, their checks and one batch decoded, shared by
  `pipeline.generate`, `pipeline.evaluate`, `pipeline.lm_eval` and the experiment.
"""
