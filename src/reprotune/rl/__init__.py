"""Online RL on the adapter: objective=grpo (TRL's GRPOTrainer) with verifiable rewards (docs/grpo.md).

    prompts   the prompt-only data prepare writes (data/prompts) and train reads
    rewards   the reward functions by name or path/to/file.py:function, checked and recorded
    trainer   GRPOConfig from the groups, the manifest's objective record
"""
