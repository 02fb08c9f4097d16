"""Sharded pretraining and fine-tuning: `python -m delta_jax.train --config configs/NAME.yaml`.

  config       YAML + `section.key=value` overrides -> RunConfig (frozen dataclasses)
  optimizer    AdamW after global-norm clipping, warmup + cosine, decay mask, routing lr
  state        the functional train state and its shardings from logical axes
  trainable    train.trainable: the parameters a run trains, the tree's trainable/frozen split
  step         the jitted train step (donated state, gradient accumulation), eval, routing probe
  checkpoints  Orbax: async saves, keep the last K, resume onto any mesh
  metrics      progress line, metrics.jsonl, TensorBoard, analytic FLOPs and MFU
  plots        loss curve and routing heatmap PNGs
  loop         the run
"""
