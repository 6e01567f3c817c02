"""The checked-in gRPC stubs are exactly what protoc makes from schemas/proto today."""

from __future__ import annotations

from pathlib import Path

from services.contracts.stubs import STUBS_DIR, generate


def test_grpc_stubs_are_current(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert set(fresh) == {"inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"}
    for name, data in fresh.items():
        assert (STUBS_DIR / name).read_bytes() == data, \
            f"{name} is stale: run python -m services.contracts.stubs"


def test_inference_contract_shape() -> None:
    from services.contracts.grpc import inference_pb2 as pb
    from services.contracts.grpc import inference_pb2_grpc as rpc

    request = pb.GenerateRequest(
        tenant=pb.TenantSignature(org_id="acme", team_id="ml", project_id="bot", user_id="u1",
                                  compliance_scope="hipaa", region_hint="eu",
                                  qos_tier=pb.QOS_TIER_GOLD),
        adapter=pb.AdapterRef(pinned=pb.PinnedVersion(adapter_id="acme-support", version=3)),
        text="hello", sampling=pb.SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9,
                                                 seed=1, stop=["\n"]))
    assert pb.GenerateRequest.FromString(request.SerializeToString()) == request
    assert request.adapter.WhichOneof("ref") == "pinned"
    final = pb.GenerateResponse(final=pb.FinalUsage(
        served_adapter=pb.ServedAdapter(adapter_id="acme-support", version=3, sha256="ab" * 32),
        trace_id="0" * 32, prompt_tokens=1, completion_tokens=2))
    assert final.WhichOneof("kind") == "final"
    method = rpc.InferenceStub.__init__.__code__.co_names
    assert "unary_stream" in method, "Generate must be server-streaming"
