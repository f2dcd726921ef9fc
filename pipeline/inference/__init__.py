"""Decoding and the pieces every decoding command shares, as a package.

- `decoding.py`: plan-and-infill (ReFusion) and AR decoding with one KV cache;
- `loading.py`: a Hugging Face folder or a training checkpoint loaded for inference, with its
  tokenizer, on the chosen device and dtype;
- `cli.py`: the decoding options, their checks and one batch decoded, shared by
  `pipeline.generate`, `pipeline.evaluate`, `pipeline.lm_eval` and the experiment.
"""
