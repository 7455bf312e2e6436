"""The Megatron backend (`train.backend: megatron`): megatron-core training of Qwen3 and Qwen3-MoE.

    compat.py      the shims megatron-core needs on a machine without CUDA (one place, with the reasons)
    model.py       HF config -> megatron-core TransformerConfig / GPTModel; what is refused
    parallel.py    Megatron's process groups and seeded RNG over the trainer world
    hf_weights.py  HF <-> Megatron weights (load into a rank, gather back, checkpoint keys -> HF)
    forward.py     masks and TP-gathered logits, an HF-like causal LM view of a GPTModel
    trainer.py     MegatronTrainer: the step of train/step.py over megatron-core's schedule and optimizer

Checkpoints: `relax_core/checkpoint/megatron.py`. Importing this package imports nothing heavy.
"""
