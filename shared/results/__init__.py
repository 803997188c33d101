"""Results and monitoring: experiment tracking backends (TensorBoard, wandb, MLflow), plots and summaries of a
run's ``metrics.jsonl``, and the Prometheus exporter of live metrics. Imports the kernel only.
"""
