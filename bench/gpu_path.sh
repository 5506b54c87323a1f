#!/usr/bin/env bash
# The client's GPU path for real, on a machine with a CUDA card: `diloco serve` with its
# embedded Postgres, a Llama run on a BPE dataset (examples/gpu-llama.toml), then
#   - `diloco doctor` at auto precision, at fp16 (loss scaling), and capped to 8 GiB of
#     the card (--gpu-memory 8: the micro-batch shrinks, gradients accumulate);
#   - `diloco join` for two rounds on the whole card, then two rounds as a second
#     volunteer in fp16 within 8 GiB.
# Usage: bash bench/gpu_path.sh CORPUS.txt OUT_DIR [CONFIG]   (figures: OUT_DIR/*.json, *.log)
set -euo pipefail
corpus=$1 out=$2 config=${3:-examples/gpu-llama.toml}
work=out/gpu port=${DILOCO_GPU_PORT:-8765}
url=http://127.0.0.1:$port
mkdir -p "$out" "$work"
dl() { python3 -m client.cli "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_capability())" | tee -a "$out/gpu.txt"

for _ in 1 2 3 4 5 6 7 8 9 10; do cat "$corpus"; done > "$work/corpus.txt"
dl data prepare "$work/corpus.txt" --out "$work/dataset" --tokenizer train:4096 2>&1 | tail -3

# python3 itself in the background (not through dl): $! is then the server's own PID
DILOCO_DATABASE_URL="" python3 -m client.cli serve --port "$port" --data-dir "$work/server" \
    > "$out/server.log" 2>&1 &
server=$!
stop() {  # a background job ignores SIGINT: TERM, then KILL if it lingers
    kill -TERM "$server" 2> /dev/null || return 0
    for _ in $(seq 30); do kill -0 "$server" 2> /dev/null || return 0; sleep 1; done
    kill -KILL "$server" 2> /dev/null || true
}
trap stop EXIT
for _ in $(seq 120); do
    kill -0 "$server" || { echo "the server exited; see $out/server.log"; exit 1; }
    curl -fsS "$url/healthz" > /dev/null 2>&1 && break
    sleep 1
done
token=$(cat "$work/server/admin-token")
dl run create "$config" --server "$url" --admin-token "$token" --json > "$out/run.json"
run=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['id'])" "$out/run.json")
echo "run $run"

dl doctor "$url" --run "$run" --json > "$out/doctor-auto.json" || true
dl doctor "$url" --run "$run" --precision fp16 --json > "$out/doctor-fp16.json" || true
dl doctor "$url" --run "$run" --gpu-memory 8 --json > "$out/doctor-8gib.json" || true

vol() {  # NAME LOG ARGS...: one volunteer with its own identity and cache
    local name=$1 log=$2; shift 2
    DILOCO_CONFIG_DIR="$work/$name/config" DILOCO_CACHE_DIR="$work/$name/cache" \
        dl join "$url" --run "$run" --name "$name" "$@" > "$out/$log" 2>&1
}
vol gpu-a join-bf16.log --max-rounds 2 || echo "volunteer gpu-a exited $?"
vol gpu-b join-fp16-8gib.log --max-rounds 2 --precision fp16 --gpu-memory 8 || echo "volunteer gpu-b exited $?"
curl -fsS "$url/api/v1/runs/$run/rounds" > "$out/rounds.json" || true
nvidia-smi --query-gpu=memory.used --format=csv >> "$out/gpu.txt" || true
