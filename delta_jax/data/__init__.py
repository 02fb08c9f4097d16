"""Input pipeline: tokenizers, data preparation, the embedded corpus and Grain readers.

  tokenizers  get_tokenizer("byte" | "qwen3" | path to tokenizer.json)
  prepare     text/JSONL/Parquet -> tokenised ArrayRecord shards
              (`python -m delta_jax.data prepare`)
  corpus      the embedded default corpus (standard-library docstrings) and its prepared cache
  pipeline    build_batch_iterator / build_eval_iterator / to_global_array for the trainer

Submodules are imported on demand so that the preparation workers stay light.
"""
