#!/usr/bin/env bash
# Issue 41's target on a GPU host: 8 LeRobot robot_clients at once >= 4x one client's req/s (bench/grpc_clients.py,
# a tiny SmolVLA served on the GPU, each client a process of its own on the host's cores), beside the same counts
# over the WebSocket. The tree travels as a snapshot (.snap) with the wheels the image lacks (.whl: lerobot 0.6.1
# and its pins, grpcio 1.85.4 + protobuf 7.36.2 for LeRobot's gRPC stubs, websockets, pydantic):
#   run(command="cd .snap && bash bench/device_grpc.sh", carry=[".whl", ".snap"])
# ROUNDS, SECONDS_PER_ROW and CLIENTS override the defaults; the table lands in $OUT/grpc-clients-cuda.md.
DEFAULT_BUDGET_S=570
source "$(dirname "$0")/device_lib.sh"
python3 -c "import grpc; print('grpcio', grpc.__version__)"
stage grpc-clients-cuda 5 python3 "$REPO/bench/grpc_clients.py" --device cuda --clients "${CLIENTS:-1,8,16}" \
    --seconds "${SECONDS_PER_ROW:-12}" --rounds "${ROUNDS:-2}" --pattern robot-client --websocket \
    --out "$OUT/grpc-clients-cuda.md"
