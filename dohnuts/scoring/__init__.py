"""Math on candidate logits [B, K]: the training objective, evaluation metrics, temperature calibration."""
