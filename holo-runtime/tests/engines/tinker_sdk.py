"""The `tinker` SDK against `holo tinker-serve`: what tests/engines/tinker_serve.rs checks.

    python tinker_sdk.py train BASE_URL MODEL OUT           # writes one JSON object of measurements
    python tinker_sdk.py restart BASE_URL MODEL OUT BEFORE  # BEFORE: the `train` phase's OUT

Every call goes through the SDK's public API; errors are recorded (status and message) for the Rust side
to check, so that this script states no expectation of its own beyond what it must assume to go on.
"""

import json
import math
import os
import sys

import tinker
import torch
from tinker import types

phase, base_url, model, out_path = sys.argv[1:5]
service = tinker.ServiceClient(base_url=base_url, api_key="tml-holo-test")
out = {}


def error_of(call):
    """Runs `call`, which must fail: its status code (when an HTTP error) and message."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - every failure is what is measured
        status = getattr(error, "status_code", None)
        return {"status": status, "message": str(error), "type": type(error).__name__}
    return {"status": None, "message": "no error", "type": None}


def datum(tokens, **inputs):
    """Reads tokens[:-1] and predicts tokens[1:], with float inputs aligned with the targets."""
    fields = {"target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1])}
    for name, values in inputs.items():
        fields[name] = types.TensorData(data=values, dtype="float32", shape=[len(values)])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fields)


def values(tensor):
    return [float(v) for v in tensor.tolist()]


PROMPT = [5, 17, 42, 9, 23]
PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1234, stop=[])

if phase == "train":
    caps = service.get_server_capabilities()
    out["models"] = [m.model_name for m in caps.supported_models]
    out["unknown_base"] = error_of(
        lambda: service.create_lora_training_client(base_model="no/such-model", rank=4).result()
    )
    tc = service.create_lora_training_client(base_model=model, rank=4, seed=0).result()
    info = tc.get_info()
    out["info"] = {"model_id": info.model_id, "lora_rank": info.lora_rank, "is_lora": info.is_lora}

    # Sampling from the initial adapter, with per-token and prompt log-probabilities.
    sampler_path = tc.save_weights_for_sampler("initial").result().path
    out["sampler_path"] = sampler_path
    sc = service.create_sampling_client(model_path=sampler_path)
    sampled = sc.sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=PARAMS,
        include_prompt_logprobs=True, topk_sample_logprobs=3,
    ).result()
    out["samples"] = [
        {
            "tokens": s.tokens,
            "logprobs": s.logprobs,
            "stop_reason": s.stop_reason,
            "topk": [[[int(t), float(lp)] for t, lp in position] for position in s.topk_logprobs],
        }
        for s in sampled.sequences
    ]
    out["prompt_logprobs"] = [None if v is None or math.isnan(v) else v for v in sampled.prompt_logprobs]

    # What tinker-cookbook's KL penalty asks of a sampler: the prompt's log-probabilities, all or the last N.
    def clean(values):
        return [None if v is None or math.isnan(v) else v for v in values]

    out["computed"] = clean(sc.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result())
    out["computed_last_2"] = clean(
        sc.compute_logprobs(types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=2).result()
    )

    # The trainer's log-probabilities of the first sample's tokens (forward, no gradient).
    first = out["samples"][0]["tokens"]
    sequence = PROMPT + first
    weights = [0.0] * (len(PROMPT) - 1) + [1.0] * len(first)
    forward = tc.forward([datum(sequence, weights=weights)], "cross_entropy").result()
    out["forward_logprobs"] = values(forward.loss_fn_outputs[0]["logprobs"])
    out["forward_loss"] = forward.metrics["loss:sum"]

    # Two training clients at once on the one base model: a step of the second leaves the first as it was.
    second = service.create_lora_training_client(base_model=model, rank=2, seed=1, train_mlp=False).result()
    second.forward_backward([datum(sequence, weights=weights)], "cross_entropy").result()
    second.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    out["second_moved"] = second.forward([datum(sequence, weights=weights)], "cross_entropy").result().metrics["loss:sum"]
    out["first_after_second"] = tc.forward([datum(sequence, weights=weights)], "cross_entropy").result().metrics["loss:sum"]
    second_state = second.save_state("second").result().path

    # Each RL loss on the same datum with on-policy sampler log-probabilities (the forward's).
    advantages = [0.0] * (len(PROMPT) - 1) + [1.0, -0.5, 2.0, 0.25, -1.0, 0.5][: len(first)]
    losses = {}
    for loss_fn, config in [
        ("importance_sampling", None),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", None),
    ]:
        result = tc.forward_backward(
            [datum(sequence, logprobs=out["forward_logprobs"], advantages=advantages)], loss_fn, config
        ).result()
        losses[loss_fn] = {
            "loss": result.metrics["loss:sum"],
            "logprobs": values(result.loss_fn_outputs[0]["logprobs"]),
            "elementwise": values(result.loss_fn_outputs[0]["elementwise_loss"]),
        }
    out["advantages"] = advantages
    out["rl"] = losses

    # DRO off-policy (the sampler's log-probabilities moved from the trainer's, so that its quadratic
    # penalty counts), with the reference computed here as Tinker's documentation writes it.
    beta = 0.5
    sampler_logprobs = [lp + 0.2 * ((i % 3) - 1) for i, lp in enumerate(out["forward_logprobs"])]
    result = tc.forward_backward(
        [datum(sequence, logprobs=sampler_logprobs, advantages=advantages)], "dro", {"beta": beta}
    ).result()
    target_logprobs = torch.tensor(values(result.loss_fn_outputs[0]["logprobs"]), dtype=torch.float64)
    quadratic_term = (target_logprobs - torch.tensor(sampler_logprobs, dtype=torch.float64)) ** 2
    dro_objective = target_logprobs * torch.tensor(advantages, dtype=torch.float64) - 0.5 * beta * quadratic_term
    out["dro"] = {
        "loss": result.metrics["loss:sum"],
        "logprobs": target_logprobs.tolist(),
        "elementwise": values(result.loss_fn_outputs[0]["elementwise_loss"]),
        "reference": float(-dro_objective.sum()),
        "reference_elementwise": (-dro_objective).tolist(),
    }
    out["rl_step"] = tc.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).result().metrics

    # A custom loss (forward_backward_custom: the SDK's forward, the loss and its gradient in torch here,
    # then a cross_entropy whose weights are that gradient) against the built-in loss it restates:
    # importance sampling, off-policy. Two clients from the same seed take one step each, with an
    # epsilon so large that AdamW's first step, lr·g/(|g| + eps), grows with the gradient instead of
    # being its sign: equal weights after the step mean equal gradients, not just equal signs (by hand,
    # advantages 1.1 times as large moved the loss after the step from 94.0 to 100.0).
    def custom_importance_sampling(data, logprobs_list):
        loss = sum(
            -(torch.exp(lp - d.loss_fn_inputs["logprobs"].to_torch()) * d.loss_fn_inputs["advantages"].to_torch()).sum()
            for d, lp in zip(data, logprobs_list, strict=True)
        )
        return loss, {"custom:sum": float(loss)}

    off_policy = [datum(sequence, logprobs=sampler_logprobs, advantages=advantages)]
    linear = types.AdamParams(learning_rate=1.0, eps=100.0)
    pair = [service.create_lora_training_client(base_model=model, rank=2, seed=7).result() for _ in range(2)]
    custom = pair[0].forward_backward_custom(off_policy, custom_importance_sampling).result()
    builtin = pair[1].forward_backward(off_policy, "importance_sampling").result()
    before = pair[0].forward([datum(sequence, weights=weights)], "cross_entropy").result().metrics["loss:sum"]
    for client in pair:
        client.optim_step(linear).result()
    out["custom"] = {
        "metrics": custom.metrics,
        "builtin_loss": builtin.metrics["loss:sum"],
        "before": before,
        "after": [
            client.forward([datum(sequence, weights=weights)], "cross_entropy").result().metrics["loss:sum"]
            for client in pair
        ],
    }

    # Refusals.
    out["unknown_loss"] = error_of(lambda: tc.forward_backward([datum(sequence, weights=weights)], "gspo").result())
    out["dro_without_beta"] = error_of(
        lambda: tc.forward_backward(
            [datum(sequence, logprobs=out["forward_logprobs"], advantages=advantages)], "dro"
        ).result()
    )
    out["unknown_setting"] = error_of(
        lambda: tc.forward_backward(
            [datum(sequence, logprobs=out["forward_logprobs"], advantages=advantages)], "ppo", {"beta": 0.1}
        ).result()
    )
    out["bad_shape"] = error_of(
        lambda: tc.forward_backward([datum(sequence, weights=weights[:-1])], "cross_entropy").result()
    )
    out["missing_input"] = error_of(
        lambda: tc.forward_backward([datum(sequence, weights=weights)], "importance_sampling").result()
    )
    out["unknown_checkpoint"] = error_of(lambda: tc.load_state("tinker://nope/weights/none").result())

    # A supervised loop on one fixed sequence: the loss must fall.
    text = [7, 3, 11, 29, 31, 2, 8, 19, 4, 13, 6, 21]
    sl = [datum(text, weights=[1.0] * (len(text) - 1))]
    curve = []
    for _ in range(8):
        result = tc.forward_backward(sl, "cross_entropy").result()
        curve.append(result.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    out["sl_losses"] = curve
    out["sl_after"] = tc.forward(sl, "cross_entropy").result().metrics["loss:sum"]

    # Checkpoints: a training state, loaded back into this client and into a new one with its optimizer.
    state_path = tc.save_state("after-sl", ttl_seconds=3600).result().path
    # A checkpoint whose TTL has passed (0 s: at once) is gone.
    expired = tc.save_state("expired", ttl_seconds=0).result().path
    out["expired"] = error_of(lambda: tc.load_state(expired).result())
    out["state_path"] = state_path
    # What each run's adapter trains, as `tinker checkpoint info` asks (both asked for train_unembed, the
    # SDK's default).
    rest = service.create_rest_client()
    out["weights_info"] = [
        rest.get_weights_info_by_tinker_path(path).result().model_dump(mode="json")
        for path in (state_path, second_state)
    ]
    trained_sampler = tc.save_weights_for_sampler("after-sl").result().path
    out["trained_sampler_path"] = trained_sampler
    snapshot = tc.save_weights_and_get_sampling_client().result()
    out["snapshot_sample"] = snapshot.sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS
    ).result().sequences[0].tokens
    out["trained_sample"] = service.create_sampling_client(model_path=trained_sampler).sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS
    ).result().sequences[0].tokens
    # As many newer snapshots as the server keeps (SNAPSHOTS_KEPT, from the Rust side): the first is
    # dropped, the newest samples.
    newer = [tc.save_weights_and_get_sampling_client().result() for _ in range(int(os.environ["SNAPSHOTS_KEPT"]))]
    out["dropped_snapshot"] = error_of(lambda: snapshot.sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS
    ).result())
    out["newest_snapshot_sample"] = newer[-1].sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS
    ).result().sequences[0].tokens
    tc.forward_backward(sl, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    out["moved"] = tc.forward(sl, "cross_entropy").result().metrics["loss:sum"]
    tc.load_state(state_path).result()
    out["reloaded"] = tc.forward(sl, "cross_entropy").result().metrics["loss:sum"]
    other = service.create_training_client_from_state_with_optimizer(state_path).result()
    out["other_loaded"] = other.forward(sl, "cross_entropy").result().metrics["loss:sum"]
    # One more identical step on both, the first with its optimizer's state loaded too: same weights
    # and same moments give the same loss after.
    tc.load_state_with_optimizer(state_path).result()
    for client in (tc, other):
        client.forward_backward(sl, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    out["stepped"] = [client.forward(sl, "cross_entropy").result().metrics["loss:sum"] for client in (tc, other)]
    out["run_id"] = info.model_id
    with open(out_path, "w") as file:
        json.dump(out, file)

elif phase == "restart":
    with open(sys.argv[5]) as file:
        before = json.load(file)
    text = [7, 3, 11, 29, 31, 2, 8, 19, 4, 13, 6, 21]
    sl = [datum(text, weights=[1.0] * (len(text) - 1))]
    restored = service.create_training_client_from_state(before["state_path"]).result()
    out["restored_loss"] = restored.forward(sl, "cross_entropy").result().metrics["loss:sum"]
    out["restored_sample"] = service.create_sampling_client(model_path=before["trained_sampler_path"]).sample(
        prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS
    ).result().sequences[0].tokens
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(before["run_id"]).result()
    out["listed"] = sorted(c.tinker_path for c in listed.checkpoints)
    rest.delete_checkpoint(before["run_id"], "sampler_weights/initial").result()
    out["after_delete"] = sorted(c.tinker_path for c in rest.list_checkpoints(before["run_id"]).result().checkpoints)
    out["deleted_sampler"] = error_of(
        lambda: service.create_sampling_client(model_path=before["sampler_path"]).sample(
            prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=PARAMS
        ).result()
    )
    with open(out_path, "w") as file:
        json.dump(out, file)
else:
    sys.exit(f"unknown phase {phase}")
