"""The stand-alone verifier: signed notes (against the reference implementation's own
test vector), C2SP checkpoints, inclusion and consistency proof documents, and the file
run on its own, copied away from the project."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from services.audit import verifier
from services.audit.merkle import consistency_path, inclusion_path, leaf_hash, root_from_hashes
from services.audit.verifier import (
    Checkpoint,
    EvidenceError,
    check_consistency,
    check_inclusion,
    open_checkpoint,
    open_note,
    parse_checkpoint,
    parse_verifier_key,
    sign_note,
    verifier_key,
)

# golang.org/x/mod/sumdb/note's own test vector (note_test.go)
PETER_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
PETER_SEED = base64.b64decode("AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz")[1:]
PETER_TEXT = ("If you think cryptography is the answer to your problem,\n"
              "then you don't know what your problem is.\n")
PETER_NOTE = PETER_TEXT + ("\n\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuG"
                           "UgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n")

ORIGIN = "audit.example.com/lp/t.worker-events/1"
SEED = bytes(range(32))


def _key() -> tuple[Ed25519PrivateKey, bytes]:
    private = Ed25519PrivateKey.from_private_bytes(SEED)
    return private, private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _note(size: int, root: bytes, origin: str = ORIGIN) -> str:
    private, public = _key()
    return sign_note(Checkpoint(origin, size, root).text(), origin, private.sign, public)


def _vkey(origin: str = ORIGIN) -> verifier.NoteKey:
    return parse_verifier_key(verifier_key(origin, _key()[1]))


def test_note_format_matches_the_reference_implementation_vector() -> None:
    private = Ed25519PrivateKey.from_private_bytes(PETER_SEED)
    public = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    assert verifier_key("PeterNeumann", public) == PETER_VKEY
    assert sign_note(PETER_TEXT, "PeterNeumann", private.sign, public) == PETER_NOTE
    text, signers = open_note(PETER_NOTE, [parse_verifier_key(PETER_VKEY)])
    assert text == PETER_TEXT and signers[0].name == "PeterNeumann"


@pytest.mark.parametrize("note", [
    PETER_NOTE.replace("problem,", "problem;"),  # text changed
    PETER_NOTE.replace("x08go", "x08gp"),  # signature changed
])
def test_a_changed_note_fails(note: str) -> None:
    with pytest.raises(EvidenceError):
        open_note(note, [parse_verifier_key(PETER_VKEY)])


def test_unknown_signers_are_ignored_but_one_trusted_signature_is_required() -> None:
    other = PETER_NOTE + "\u2014 witness.example AAAAAAAAAAAAAAAA\n"
    open_note(other, [parse_verifier_key(PETER_VKEY)])  # a cosignature we do not know
    with pytest.raises(EvidenceError, match="not signed by a trusted key"):
        open_note(PETER_NOTE, [_vkey()])


@pytest.mark.parametrize("vkey", [
    "PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # hash
    "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # name
    "PeterNeumann+c74f20a3+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # algorithm
    "PeterNeumann+c74f20a3",
])
def test_bad_verifier_keys_are_refused(vkey: str) -> None:
    with pytest.raises(EvidenceError):
        parse_verifier_key(vkey)


def test_checkpoint_text_is_the_c2sp_body() -> None:
    root = bytes(range(32))
    text = Checkpoint(ORIGIN, 20852163, root).text()
    assert text == f"{ORIGIN}\n20852163\n{base64.b64encode(root).decode()}\n"
    assert parse_checkpoint(text) == Checkpoint(ORIGIN, 20852163, root)
    for bad in (f"{ORIGIN}\n012\n{base64.b64encode(root).decode()}\n",
                f"{ORIGIN}\n12\nAAAA\n", f"{ORIGIN}\n12\n", f"{ORIGIN}\n\n12\nAA==\n"):
        with pytest.raises(EvidenceError):
            parse_checkpoint(bad)


def test_a_checkpoint_must_be_signed_by_the_key_named_like_its_origin() -> None:
    note = _note(3, bytes(32))
    assert open_checkpoint(note, [_vkey()]).size == 3
    private, public = _key()
    elsewhere = sign_note(Checkpoint(ORIGIN, 3, bytes(32)).text(), "other-log", private.sign,
                          public)
    with pytest.raises(EvidenceError, match="not by the log's key"):
        open_checkpoint(elsewhere, [_vkey("other-log")])


LEAVES = [json.dumps({"event_id": f"id-{i}", "n": i}).encode() for i in range(13)]
HASHES = [leaf_hash(leaf) for leaf in LEAVES]


def _inclusion(index: int = 5, size: int = 12) -> dict:
    return {"format": verifier.INCLUSION_FORMAT, "event_id": f"id-{index}",
            "leaf": base64.b64encode(LEAVES[index]).decode(), "leaf_index": index,
            "inclusion_path": [base64.b64encode(h).decode()
                               for h in inclusion_path(HASHES[:size], index)],
            "checkpoint": _note(size, root_from_hashes(HASHES[:size]))}


def _consistency(old: int = 5, new: int = 13) -> dict:
    return {"format": verifier.CONSISTENCY_FORMAT,
            "old_checkpoint": _note(old, root_from_hashes(HASHES[:old])),
            "new_checkpoint": _note(new, root_from_hashes(HASHES[:new])),
            "consistency_path": [base64.b64encode(h).decode()
                                 for h in consistency_path(HASHES[:new], old)]}


def test_inclusion_proof_holds_and_each_tampering_is_named() -> None:
    assert check_inclusion(_inclusion(), [_vkey()]).size == 12
    forged = _inclusion()
    forged["leaf"] = base64.b64encode(LEAVES[5].replace(b'"n": 5', b'"n": 6')).decode()
    with pytest.raises(EvidenceError, match="inclusion path"):
        check_inclusion(forged, [_vkey()])
    moved = dict(_inclusion(), leaf_index=4)
    with pytest.raises(EvidenceError, match="inclusion path"):
        check_inclusion(moved, [_vkey()])
    resigned = dict(_inclusion(), checkpoint=_note(12, bytes(32)))
    with pytest.raises(EvidenceError, match="inclusion path"):
        check_inclusion(resigned, [_vkey()])
    with pytest.raises(EvidenceError, match="trusted"):
        check_inclusion(_inclusion(), [_vkey("someone-else")])
    renamed = dict(_inclusion(), event_id="id-7")
    with pytest.raises(EvidenceError, match="names"):
        check_inclusion(renamed, [_vkey()])


def test_consistency_proof_holds_and_a_fork_fails() -> None:
    old, new = check_consistency(_consistency(), [_vkey()])
    assert (old.size, new.size) == (5, 13)
    fork = _consistency()
    fork["old_checkpoint"] = _note(5, root_from_hashes([*HASHES[:4], leaf_hash(b"forged")]))
    with pytest.raises(EvidenceError, match="does not extend"):
        check_consistency(fork, [_vkey()])
    two_logs = dict(_consistency(), new_checkpoint=_note(13, root_from_hashes(HASHES),
                                                         origin="audit.example.com/x/0"))
    with pytest.raises(EvidenceError):
        check_consistency(two_logs, [_vkey(), _vkey("audit.example.com/x/0")])


def test_the_verifier_runs_alone_copied_out_of_the_project(tmp_path: Path) -> None:
    script = tmp_path / "verifier.py"
    shutil.copy(verifier.__file__, script)
    source = script.read_text()
    assert "services" not in "".join(line for line in source.splitlines()
                                     if line.startswith(("import ", "from ")))
    (tmp_path / "inclusion.json").write_text(json.dumps(_inclusion()))
    (tmp_path / "consistency.json").write_text(json.dumps(_consistency()))
    (tmp_path / "checkpoint").write_text(_note(12, root_from_hashes(HASHES[:12])))
    vkey = _vkey().vkey

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-I", str(script), *args, "--key", vkey],
                              capture_output=True, text=True, cwd=tmp_path)

    for kind, name in (("inclusion", "inclusion.json"), ("consistency", "consistency.json"),
                       ("checkpoint", "checkpoint")):
        done = run(kind, name)
        assert done.returncode == 0 and done.stdout.startswith("OK"), done.stdout + done.stderr
    (tmp_path / "inclusion.json").write_text(json.dumps(dict(_inclusion(), leaf_index=4)))
    bad = run("inclusion", "inclusion.json")
    assert bad.returncode == 1 and "INVALID" in bad.stdout
