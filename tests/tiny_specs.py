"""Small specs that several test files train: specs/lstm_lm.yaml shrunk by overrides, and a tiny
convolution model with batch norm."""

# --set overrides that make specs/lstm_lm.yaml train in milliseconds (append the optimizer)
SHRINK_LM = ["training.batch_size=4", "model.layers.lstm_1.units=12", "model.layers.lstm_2.units=12",
             "model.layers.embedding.dim=8", "model.layers.embedding.vocab=40", "model.layers.tokens.classes=40",
             "model.layers.targets.classes=40", "model.layers.softmax.units=40", "model.layers.tokens.shape=[5]",
             "model.layers.targets.shape=[5]"]

TINY_CONV = """\
version: 1
name: tiny_conv
model:
  layers:
    - {name: x, type: input, shape: [6, 6, 2]}
    - {name: c1, type: conv2d, filters: 4, kernel: 3, padding: same, batch_norm: true, activation: relu}
    - {name: c2, type: conv2d, filters: 4, kernel: 3, padding: same, activation: relu}
    - {name: flat, type: flatten}
    - {name: logits, type: dense, units: 3}
    - {name: y, type: input, shape: [], dtype: int32, classes: 3}
    - {name: loss, type: softmax_cross_entropy, inputs: [logits, y]}
data: {source: synthetic, seed: 1}
training:
  optimizer: {type: momentum}
  learning_rate: 0.05
  batch_size: 4
  steps: 6
  clip_norm: 1.0
  seed: 2
checkpoint: {every_steps: 100, keep: 2}
"""

# A two-layer LSTM LM split over two CPU devices by model parallelism.
LM_TWO_DEVICES = """\
version: 1
name: lstm2
model:
  layers:
    - {name: tokens, type: input, shape: [8], dtype: int32, classes: 200}
    - {name: embedding, type: embedding, vocab: 200, dim: 32}
    - {name: lstm_1, type: lstm, units: 48}
    - {name: lstm_2, type: lstm, units: 48}
    - {name: softmax, type: dense, units: 200}
    - {name: targets, type: input, shape: [8], dtype: int32, classes: 200}
    - {name: loss, type: softmax_cross_entropy, inputs: [softmax, targets]}
devices: [cpu:0, cpu:1]
parallelism:
  strategy: model_parallel
  groups:
    - {layers: [embedding, lstm_1], device: cpu:0}
    - {layers: [lstm_2, softmax, loss], device: cpu:1}
training: {optimizer: {type: sgd}, learning_rate: 0.5, batch_size: 8, steps: 3}
"""
