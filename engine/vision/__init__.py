"""Image encoders of multimodal checkpoints: what turns an image's pixels into rows of the text
model's embeddings, placed at the prompt's image tokens."""
