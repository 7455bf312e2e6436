"""The services of the asynchronous modes: each role its own Ray actor group, joined by TransferQueue.

    rollout service (rollout group)      reference workers (own group, or next to the trainer)
      engines, manager, reward hub           frozen reference model: "ref_logprobs" per token
      step s: prompts -> samples --put-->  [ TransferQueue partition s ] <--process-- advantage service
      record (counts, ids, times) -----+           |                               (outcome estimators)
                                       v           | the trainer ranks fetch their own shards
      driver: metadata only, claims complete rows -+-> trainer ranks (train group)

Beside trainer rank 0 run the actor-forward worker ("old_logprobs") and PPO's
critic worker ("values" before a step; after it, an update on the "returns"
the trainer ranks write back: critic.py). `mode: fully_async` runs all of
them; `mode: hybrid` only the rollout service (the trainer ranks compute
reference log-probs, advantages and the critic in their own processes);
`mode: colocate` none (rollout and training take turns in the driver's
loop). `placement.py` says where each actor runs.
"""
