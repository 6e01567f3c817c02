// Command goverify checks loraplane audit evidence with the Go reference libraries
// (golang.org/x/mod/sumdb/note and sumdb/tlog), reading one JSON request on stdin:
//
//	{"vkeys": [...], "checkpoints": [note...],
//	 "inclusion": [{"note": ..., "leaf": base64, "index": n, "path": [base64...]}],
//	 "consistency": [{"old": note, "new": note, "path": [base64...]}]}
//
// It prints one line per item, "ok" or the error, and exits 1 if any item failed.
package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

type request struct {
	VKeys       []string `json:"vkeys"`
	Checkpoints []string `json:"checkpoints"`
	Inclusion   []struct {
		Note  string   `json:"note"`
		Leaf  string   `json:"leaf"`
		Index int64    `json:"index"`
		Path  []string `json:"path"`
	} `json:"inclusion"`
	Consistency []struct {
		Old  string   `json:"old"`
		New  string   `json:"new"`
		Path []string `json:"path"`
	} `json:"consistency"`
}

type checkpoint struct {
	origin string
	size   int64
	root   tlog.Hash
}

// open verifies a signed note and parses its C2SP tlog-checkpoint body.
func open(msg string, verifiers note.Verifiers) (checkpoint, error) {
	n, err := note.Open([]byte(msg), verifiers)
	if err != nil {
		return checkpoint{}, err
	}
	lines := strings.Split(n.Text, "\n")
	if len(lines) < 4 {
		return checkpoint{}, fmt.Errorf("checkpoint has fewer than three lines")
	}
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil {
		return checkpoint{}, err
	}
	root, err := tlog.ParseHash(lines[2])
	if err != nil {
		return checkpoint{}, err
	}
	if n.Sigs[0].Name != lines[0] {
		return checkpoint{}, fmt.Errorf("signed by %s, origin %s", n.Sigs[0].Name, lines[0])
	}
	return checkpoint{lines[0], size, root}, nil
}

func hashes(values []string) ([]tlog.Hash, error) {
	out := make([]tlog.Hash, len(values))
	for i, v := range values {
		h, err := tlog.ParseHash(v)
		if err != nil {
			return nil, err
		}
		out[i] = h
	}
	return out, nil
}

func main() {
	var req request
	if err := json.NewDecoder(os.Stdin).Decode(&req); err != nil {
		fmt.Println("bad request:", err)
		os.Exit(2)
	}
	var list []note.Verifier
	for _, k := range req.VKeys {
		v, err := note.NewVerifier(k)
		if err != nil {
			fmt.Println("bad vkey:", err)
			os.Exit(2)
		}
		list = append(list, v)
	}
	verifiers := note.VerifierList(list...)
	failed := false
	report := func(kind string, err error) {
		if err != nil {
			failed = true
			fmt.Printf("%s: %v\n", kind, err)
		} else {
			fmt.Printf("%s: ok\n", kind)
		}
	}
	for _, msg := range req.Checkpoints {
		_, err := open(msg, verifiers)
		report("checkpoint", err)
	}
	for _, item := range req.Inclusion {
		err := func() error {
			cp, err := open(item.Note, verifiers)
			if err != nil {
				return err
			}
			leaf, err := base64.StdEncoding.DecodeString(item.Leaf)
			if err != nil {
				return err
			}
			path, err := hashes(item.Path)
			if err != nil {
				return err
			}
			return tlog.CheckRecord(tlog.RecordProof(path), cp.size, cp.root, item.Index,
				tlog.RecordHash(leaf))
		}()
		report("inclusion", err)
	}
	for _, item := range req.Consistency {
		err := func() error {
			old, err := open(item.Old, verifiers)
			if err != nil {
				return err
			}
			cur, err := open(item.New, verifiers)
			if err != nil {
				return err
			}
			path, err := hashes(item.Path)
			if err != nil {
				return err
			}
			return tlog.CheckTree(tlog.TreeProof(path), cur.size, cur.root, old.size, old.root)
		}()
		report("consistency", err)
	}
	if failed {
		os.Exit(1)
	}
}
