"""The checks `asyncrl-launch` (and `asyncrl submit`) run before an RL job starts, and the trainer
when it loads its inputs: what workers would otherwise fail on deep inside a run.

`RL_SCHEMA` is how the RL schema joins the launcher (the `asyncrl.schemas` entry point
`rl_schema`): its dataclass, `preflight`, and the key that receives Hydra's run directory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from asyncrl.algorithms.registry import needs_critic, needs_teacher
from asyncrl.config import FILL_TOKEN_BUDGET, ModelConfig, RLConfig
from asyncrl.engines import backend, rollout_engine
from asyncrl.models.resolve import resolve_model, tiny_settings
from asyncrl.rundir import check_output_dir
from asyncrl.single_controller.schema import JobSchema
from transport.checks import ConfigError

log = logging.getLogger("asyncrl.preflight")


def preflight(cfg: RLConfig, run_dir: str | None, head: bool) -> None:
    """Before anything starts: the run directory is ours to write (`run_dir`: Hydra's, when set
    on the command line) and, on the node that runs the driver, the model, data and reward files."""
    check_output_dir(Path(run_dir or cfg.trainer.output_dir))
    if head:
        check_files(cfg)


def check_inputs(cfg: RLConfig) -> None:
    """What the workers would otherwise fail on deep inside: data files, the reward function and
    the parallel sizes against the model (`cfg.model.path` resolved)."""
    check_files(cfg)
    _check_tp_fits_model(cfg)
    _check_sequence_parallel(cfg)
    _check_backends(cfg)
    _check_context_fits_model(cfg)
    _check_teacher(cfg)
    check_memory(cfg)


def _check_teacher(cfg: RLConfig) -> None:
    """On-policy distillation compares the teacher's log-probs of the student's token ids with the
    student's own: both must read those ids as the same tokens."""
    from transformers import AutoConfig, AutoTokenizer

    if not (cfg.teacher.path and needs_teacher(cfg.algorithm.name)):
        return
    path = cfg.teacher.path = resolve_model(ModelConfig(path=cfg.teacher.path), key="teacher.path")
    backend(cfg.teacher.backend).check("teacher", cfg.teacher, path, cfg)  # its library, and a model it maps
    student, teacher = AutoTokenizer.from_pretrained(cfg.model.path), AutoTokenizer.from_pretrained(path)
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    differ = sorted(set(s_vocab.items()) ^ set(t_vocab.items()), key=str)[:3]
    if differ or student.eos_token_id != teacher.eos_token_id:
        what = f"e.g. {differ}" if differ else f"eos ids {student.eos_token_id} vs {teacher.eos_token_id}"
        raise ConfigError(f"teacher.path={path}: its tokenizer differs from the student's (model.path="
                          f"{cfg.model.path}; {len(s_vocab)} vs {len(t_vocab)} tokens, {what}). On-policy "
                          "distillation scores the student's token ids under the teacher, so both must share "
                          "one tokenizer: pick a teacher of the same family")
    rows = getattr(AutoConfig.from_pretrained(path), "vocab_size", None)
    if rows is not None and rows < len(s_vocab):
        raise ConfigError(f"teacher.path={path}: its vocab_size {rows} is smaller than the tokenizer's "
                          f"{len(s_vocab)} tokens; the teacher cannot score every token the student samples")


def check_memory(cfg: RLConfig) -> None:
    """Log the estimated peak memory of an actor worker (`asyncrl.plan.memory`) and, on CPU
    nodes, refuse a run whose workers would not fit the node's memory together: the kernel would
    kill one mid-step. GPU memory is not checked here (the driver never touches CUDA):
    `asyncrl-plan` compares the same estimate with the device profile."""
    from asyncrl.plan.memory import fill_token_budget, worker_memory
    from asyncrl.plan.workload import model_spec
    from objectstore.memory import node_memory_bytes

    if cfg.trainer.placement != "colocated" or cfg.actor.parallel.pp > 1:
        return
    on_gpu = cfg.cluster.gpus_per_node > 0 or Path("/dev/nvidiactl").exists()  # no CUDA call on the driver
    spec, budget = model_spec(cfg.model.path), None
    per_node = min(cfg.trainer.n_workers, cfg.cluster.cpu_devices) if not on_gpu else 0
    if per_node and cfg.actor.max_tokens_per_micro_batch == FILL_TOKEN_BUDGET:  # as each worker will size it
        budget, _ = fill_token_budget(cfg, spec, False, node_memory_bytes() / per_node)
    estimate = worker_memory(cfg, spec, on_gpu=on_gpu, token_budget=budget)
    log.info("memory per actor worker (estimate, asyncrl.plan.memory): %.2f GiB at %s",
             estimate.total / 2**30, estimate.peak_phase)
    need, have = per_node * estimate.total, node_memory_bytes()
    if per_node and need > have:
        raise ConfigError(
            f"the {per_node} workers on this node need about {need / 2**30:.1f} GiB together "
            f"({estimate.total / 2**30:.2f} GiB each at {estimate.peak_phase}), more than its "
            f"{have / 2**30:.1f} GiB:\n" + "\n".join(estimate.lines()) + "\nlower trainer.n_workers per node, "
            "actor.micro_batch_size (or set actor.max_tokens_per_micro_batch), set "
            "actor.gradient_checkpointing=true, or use model.dtype=bfloat16")


def _check_context_fits_model(cfg: RLConfig) -> None:
    """A prompt and its response must fit the model's context (max_position_embeddings): vLLM
    refuses a longer max_model_len inside every worker; the native engine would run past the
    positions the model was trained on."""
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(cfg.model.path), "max_position_embeddings", None)
    need = cfg.data.max_prompt_len + cfg.rollout.max_tokens
    if context is None or need <= context:
        return
    msg = (f"data.max_prompt_len={cfg.data.max_prompt_len} + rollout.max_tokens={cfg.rollout.max_tokens} = {need} "
           f"tokens, more than the model's context of {context} (max_position_embeddings in "
           f"{cfg.model.path}/config.json); lower data.max_prompt_len or rollout.max_tokens")
    if rollout_engine(cfg.rollout.engine).hard_context_limit:
        raise ConfigError(msg)
    log.warning("%s (rollout.engine=%s runs, past the positions the model was trained on)", msg, cfg.rollout.engine)


def check_image_run(cfg: RLConfig) -> None:
    """A vision-language model's run on what reads images so far: a rollout engine and training
    backend that take them (`images` in `asyncrl.engines`: the native engine's waves, FSDP2), not
    a split pool's continuous batches or API-driven agents (the built-in multi-turn loop, whose
    observations may bring images, is fine), no pipeline stages or Ulysses, a critic that reads
    images too, no dynamic sampling's refills."""
    from asyncrl.agents.api import is_api_agent
    from asyncrl.data.images import reads_images

    mt, critic = cfg.rollout.multi_turn, needs_critic(cfg.algorithm.name)
    unsupported = [(k, v) for k, v, ok in (
        ("rollout.engine", cfg.rollout.engine, rollout_engine(cfg.rollout.engine).images),
        ("rollout.multi_turn.env", mt.env, not mt.enable or not is_api_agent(mt.env)),
        ("trainer.placement", cfg.trainer.placement, cfg.trainer.placement == "colocated"),
        ("actor.backend", cfg.actor.backend, backend(cfg.actor.backend).images),
        ("actor.parallel.pp", cfg.actor.parallel.pp, cfg.actor.parallel.pp == 1),
        ("actor.parallel.sp", cfg.actor.parallel.sp, cfg.actor.parallel.sp == 1),
        ("critic.backend", cfg.critic.backend, not critic or backend(cfg.critic.backend).images),
        ("critic.model_path", cfg.critic.model_path, not critic or not cfg.critic.model_path
         or reads_images(cfg.critic.model_path)),
        ("critic.parallel.pp", cfg.critic.parallel.pp, not critic or cfg.critic.parallel.pp == 1),
        ("critic.parallel.sp", cfg.critic.parallel.sp, not critic or cfg.critic.parallel.sp == 1),
        ("algorithm.filter_groups.enable", cfg.algorithm.filter_groups.enable, not cfg.algorithm.filter_groups.enable),
    ) if not ok]
    if unsupported:
        key, value = unsupported[0]
        raise ConfigError(f"{key}={value}: {cfg.model.path} is a vision-language model, and image prompts run "
                          "so far on the native engine in colocated placement (multi-turn: the built-in "
                          "Environment loop, not API agents), FSDP2 without pipeline stages or Ulysses (a "
                          "critic too, from a vision-language model) and no dynamic sampling; change the setting")


def _reads_images(cfg: RLConfig, path: str | None) -> bool:
    """Whether the run's model is a vision-language one (its directory's config, or a tiny build's task)."""
    from asyncrl.data.images import reads_images
    from asyncrl.data.reasoning_gym import GYM_TASK
    from asyncrl.data.synthetic import get_task

    tiny = cfg.model.build_tiny
    if tiny is not None:
        return tiny.task != GYM_TASK and get_task(tiny.task).images
    return reads_images(path)


def check_files(cfg: RLConfig) -> None:
    """The model directory (unless the run builds it), the data files (present, parquet or
    jsonl, with the prompt and ground-truth columns) and the reward functions (importable);
    `asyncrl-launch` runs this before anything starts."""
    from asyncrl.data.dataset import DatasetError, check_data_file
    from asyncrl.data.images import reads_images
    from asyncrl.rewards import load_reward_fn

    path = None
    if cfg.model.build_tiny is None:
        path = resolve_model(cfg.model)
        _check_moe(cfg, path)
    else:  # built by the job; a reasoning-gym build needs data.source's tasks
        tiny_settings(cfg.model.build_tiny, cfg.data)
        _check_moe(cfg, None)
    if cfg.critic.model_path and needs_critic(cfg.algorithm.name):
        resolve_model(ModelConfig(path=cfg.critic.model_path), key="critic.model_path")
    if cfg.cost_model.path and cfg.cost_model.enable:
        resolve_model(ModelConfig(path=cfg.cost_model.path), key="cost_model.path")
    if cfg.reward.model_path:
        cfg.reward.model_path = resolve_model(ModelConfig(path=cfg.reward.model_path), key="reward.model_path")
    if _reads_images(cfg, path):
        check_image_run(cfg)
    if cfg.actor.freeze_vision and path is not None and not reads_images(path):
        raise ConfigError(f"actor.freeze_vision=true: {cfg.model.path} has no vision tower (its config.json has no "
                          "vision_config); unset it for a text model")
    for key in ("train_files", "val_files"):
        value = getattr(cfg.data, key)
        if value:
            try:
                check_data_file(value, cfg.data.prompt_key, cfg.data.answer_key,
                                images=path is not None and reads_images(path))
            except DatasetError as e:
                raise ConfigError(f"data.{key}={value}: {e}") from None
    for key in ("fn", "cost_fn"):
        spec = getattr(cfg.reward, key)
        if spec:
            try:
                load_reward_fn(spec)
            except Exception as e:
                raise ConfigError(f"reward.{key}={spec}: {e}") from None


def _check_tp_fits_model(cfg: RLConfig) -> None:
    """Tensor-parallel sizes must divide the model's heads and intermediate size, and pipeline
    stages not outnumber its layers (read from its config.json, before any worker starts)."""
    sizes = {"actor.parallel.tp": cfg.actor.parallel.tp, "rollout.parallel.tp": cfg.rollout.parallel.tp}
    if all(v == 1 for v in sizes.values()) and cfg.actor.parallel.pp == 1:
        return
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(cfg.model.path)
    from asyncrl.train.moe import is_moe_config

    trains = backend(cfg.actor.backend)
    moe_tp = [k for k, v in sizes.items() if v > 1 and is_moe_config(model)
              and not (k == "actor.parallel.tp" and trains.moe_tensor_parallel)]
    if is_moe_config(model) and not trains.moe_pipeline and cfg.actor.parallel.pp > 1:
        raise ConfigError(f"actor.parallel.pp={cfg.actor.parallel.pp}: {cfg.model.path} is a mixture-of-experts model, "
                          "whose pipeline stages asyncrl's FSDP2 path does not load yet (experts are stored per expert, "
                          "held fused); use pp=1, or actor.backend=megatron (pipeline stages at tp=1)")
    if moe_tp:
        raise ConfigError(f"{moe_tp[0]}={sizes[moe_tp[0]]}: {cfg.model.path} is a mixture-of-experts model, which "
                          "asyncrl generates, and trains on FSDP2, without tensor parallelism for now (FSDP2 shards "
                          "its experts over the data-parallel ranks; actor.backend=megatron runs TP with sequence "
                          "parallelism and splits experts with actor.moe.ep); set it to 1")
    if cfg.actor.parallel.pp > model.num_hidden_layers:
        raise ConfigError(f"actor.parallel.pp={cfg.actor.parallel.pp} but the model ({cfg.model.path}) has "
                          f"{model.num_hidden_layers} decoder layers; choose pp <= {model.num_hidden_layers}")
    dims = {"num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": getattr(model, "num_key_value_heads", None) or model.num_attention_heads,
            "intermediate_size": model.intermediate_size}
    for key, tp in sizes.items():
        bad = [f"{k}={v}" for k, v in dims.items() if v % tp]
        if bad:
            raise ConfigError(f"{key}={tp} must divide the model's {', '.join(bad)} ({cfg.model.path}); "
                              "choose a common divisor")


def _check_sequence_parallel(cfg: RLConfig) -> None:
    """actor/critic.pack_sequences=true and parallel.sp: the model must have a varlen attention
    path (packed rows), sp must divide the heads each TP rank holds, and mixture-of-experts
    routing is not sharded over sequence-parallel ranks yet."""
    from transformers import AutoConfig

    from asyncrl.train.moe import is_moe_config
    from asyncrl.train.ulysses import SequenceParallelError, check_sp

    for role, path in (("actor", cfg.model.path), ("critic", cfg.critic.model_path or cfg.model.path)):
        section = getattr(cfg, role)
        par = section.parallel
        if role == "critic" and not needs_critic(cfg.algorithm.name):
            continue
        if section.pack_sequences and par.sp == 1:
            reason = _packing_unsupported(AutoConfig.from_pretrained(path))
            if reason:
                raise ConfigError(f"{role}.pack_sequences=true: packed rows need a varlen attention path and {reason} "
                                  f"({path}); set it to null (pack where possible) or false")
        if par.sp == 1:
            continue
        model = AutoConfig.from_pretrained(path)
        try:
            check_sp(model, par.sp, par.tp)
        except SequenceParallelError as e:
            raise ConfigError(f"{role}.parallel.sp={par.sp}: {e} ({path})") from None
        if is_moe_config(model):
            raise ConfigError(f"{role}.parallel.sp={par.sp}: {path} is a mixture-of-experts model, whose routing "
                              "asyncrl does not shard over sequence-parallel ranks yet; set sp=1")
        reason = _packing_unsupported(model)
        if reason:
            raise ConfigError(f"{role}.parallel.sp={par.sp}: Ulysses runs on packed rows and {reason} ({path}); "
                              "set sp=1")


def _packing_unsupported(config: Any) -> str | None:
    """Why the causal LM of `config` has no varlen attention path (None: it has one)."""
    import transformers

    names = getattr(config, "architectures", None) or []
    classes = [getattr(transformers, n, None) for n in names]
    if not any(c is not None and getattr(c, "_supports_attention_backend", False) for c in classes):
        return f"its architecture {names or config.model_type} does not route attention through transformers' interface"
    return None


def _check_backends(cfg: RLConfig) -> None:
    """Each training backend's own checks (asyncrl.engines): its library installed, and the model
    one it maps with the role's layout (each a paragraph naming the key, before any worker starts)."""
    roles = [("actor", cfg.actor, cfg.model.path)]
    if needs_critic(cfg.algorithm.name):
        roles.append(("critic", cfg.critic, cfg.critic.model_path or cfg.model.path))
    for name, section, path in roles:
        backend(section.backend).check(name, section, path, cfg)


def check_megatron_model(name: str, section: Any, path: str, cfg: RLConfig) -> None:
    """actor/critic/teacher.backend=megatron: the model one megatron-core maps, with tp, pp and ep that
    divide it (the teacher runs without expert parallelism)."""
    from transformers import AutoConfig

    from asyncrl.train.megatron.convert import GPTShape

    try:
        shape = GPTShape.from_hf(AutoConfig.from_pretrained(path))
        shape.check_tp(section.parallel.tp, section.parallel.pp)
        shape.check_pp(section.parallel.pp)
        shape.check_ep(1 if name == "teacher" else cfg.actor.moe.ep)
    except ConfigError as e:
        raise ConfigError(str(e).replace("actor.", f"{name}.") + f" ({path})") from None


def _check_moe(cfg: RLConfig, path: str | None) -> None:
    """actor.moe.router_replay and rollout.parallel.ep need a mixture-of-experts model (at `path`, or
    the tiny one the job builds), ep a divisor of its experts: a paragraph before anything starts."""
    ep = cfg.rollout.parallel.ep
    if cfg.actor.moe.router_replay == "none" and ep == 1:
        return
    from transformers import AutoConfig

    from asyncrl.train.moe import is_moe_config

    config = None if path is None else AutoConfig.from_pretrained(path)
    moe = cfg.model.build_tiny.experts > 0 if config is None else is_moe_config(config)
    experts = cfg.model.build_tiny.experts if config is None else (
        getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)
    model = "the tiny model this job builds" if path is None else path
    if ep > 1 and (not moe or experts % ep):
        raise ConfigError(f"bad configuration: rollout.parallel.ep={ep} splits a mixture of experts' experts over the "
                          f"ranks, and {model} has {experts or 'no'} experts: set rollout.parallel.ep to a divisor of "
                          "them, or 1")
    if cfg.actor.moe.router_replay == "none":
        return
    if not moe:
        what = "the tiny model this job builds is dense (set model.build_tiny.experts)" if path is None else (
            f"{path} is a dense model (its config.json has no num_experts / num_local_experts)")
        raise ConfigError(f"bad configuration: actor.moe.router_replay={cfg.actor.moe.router_replay} replays the "
                          f"experts a mixture-of-experts model routed to, and {what}: set actor.moe.router_replay=none")


def check_round_trip(tokenizer: Any, items: list, image_token_id: int | None = None) -> bool:
    """Warn when decoding a prompt's tokens does not give its text back (a tokenizer that drops
    spaces or maps characters to <unk> trains on something else than the data); True if all match.
    Spaces a decoder adds between tokens (word-level tokenizers) are not a difference, nor an image
    placeholder widened to its image's tokens."""
    def same(text: str, back: str) -> bool:
        return "".join(text.split()) == "".join(back.split()) and len(back.split()) >= len(text.split())

    def placeholders_once(ids: list[int]) -> list[int]:
        return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != t]

    decoded = [(it.raw_prompt, tokenizer.decode(placeholders_once(it.input_ids))) for it in items]
    bad = [(text, back) for text, back in decoded if not same(text, back)]
    if bad:
        text, back = bad[0]
        log.warning("the tokenizer does not round-trip %d of %d training prompts checked: %r decodes as %r; "
                    "check model.path's tokenizer (pre-tokenizer, normalizer, unknown characters)",
                    len(bad), len(items), text[:200], back[:200])
    return not bad


RL_SCHEMA = JobSchema(RLConfig, preflight=preflight, run_dir_key="trainer.output_dir")
