"""The services of the asynchronous modes: each role its own Ray actor group, joined by TransferQueue.

    rollout service (rollout group)      reference workers (own group, a GPU each)
      engines, manager, reward hub           frozen reference model: "ref_logprobs" per token
      step s: prompts -> samples --put-->  [ TransferQueue partition s ] <--process-- advantage service
      record (counts, ids, times) -----+           |                               (outcome estimators)
                                       v           | the trainer ranks fetch their own shards
      driver: metadata only, claims complete rows -+-> trainer ranks (train group)

`mode: fully_async` runs all of them (reference workers only on a node group
of their own, `cluster.reference`); `mode: hybrid` only the rollout service
(the trainer ranks compute reference log-probs and advantages in their own
processes); `mode: colocate` none (rollout and training take turns in the driver's
loop). `placement.py` says where each actor runs.
"""
