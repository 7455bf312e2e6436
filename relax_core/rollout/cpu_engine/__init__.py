"""The CPU rollout engine: an HTTP server speaking SGLang's native API.

On a GPU cluster the rollout engines are SGLang servers. On a machine without
a GPU (a laptop, CI, the quick start) this package stands in for them: a
FastAPI server around a `transformers` causal LM that accepts the same
`/generate`, `/pause_generation`, `/init_weights_update_group`,
`/update_weights_from_distributed`, ... requests with the same field names, so
that `relax_core.rollout.client.EngineClient` and the weight-sync path in
`relax_core.weights` run unchanged against either.

    python -m relax_core.rollout.cpu_engine --model-path DIR --port P

Modules: `protocol` (request models), `generate` (request <-> scheduler
sequences <-> response), `sampling` (next-token sampling and log-probs),
`media_inputs` (multimodal requests: media decoding and the processor, off
the event loop), `kv_batch` (the padded running batch and its KV cache,
multimodal prefill, M-RoPE decode positions), `batcher` (the
continuous-batching scheduler thread), `weight_loader` (receiving weights over
torch.distributed or by reference), `memory` (releasing and resuming memory,
colocate), `server` (the HTTP layer), `info` (health, model info and load, as
SGLang answers them), `__main__` (the command line).
Nothing heavy is imported here.
"""
