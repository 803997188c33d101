"""Models and weights: loading a run's networks and tokenizers the same way in every process (tiny random models,
local Hugging Face directories, the embedded SmolLM2, LoRA through peft), the flat bucketed weight buffer, the
weight transport between trainer and rollouters (UCX or the NATS object store) and the export of a checkpoint to
Hugging Face / PEFT format. Imports the kernel only; torch is imported inside functions where a caller may not
need it.
"""
