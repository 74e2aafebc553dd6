package opmon_test

import (
	"os"
	"regexp"
	"testing"

	opmon "opmon/client"
)

// The Go client repeats exactly what the Rust client repeats: its table is read from
// client/src/methods.rs (each method's declaration in the declare! list and its retry).
func TestTheRetryTableIsTheRustClients(t *testing.T) {
	raw, err := os.ReadFile("../src/methods.rs")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]opmon.Retry{}
	decls := regexp.MustCompile(`(?m)^\s*(agent|owner) \w+ = "([\w.]+)",[^{]*\{\s*(?://[^\n]*\n\s*)*retry: (Always|IfNotSent),`).FindAllStringSubmatch(string(raw), -1)
	if len(decls) < 20 {
		t.Fatalf("found %d method declarations in methods.rs: has its declare! list changed shape?", len(decls))
	}
	for _, d := range decls {
		rule := opmon.RetryAlways
		if d[3] == "IfNotSent" {
			rule = opmon.RetryIfNotSent
		}
		if d[1] == "owner" {
			want["backup."+d[2]] = rule
			want["restore."+d[2]] = rule
		} else {
			want[d[2]] = rule
		}
	}
	for method, rule := range want {
		if got := opmon.RetryOf(method); got != rule {
			t.Errorf("RetryOf(%q) = %v, the Rust client's is %v", method, got, rule)
		}
	}
	// Unknown methods, a newer agent's, are not repeated once sent.
	if opmon.RetryOf("backup.explode") != opmon.RetryIfNotSent || opmon.RetryOf("copy.start") != opmon.RetryIfNotSent {
		t.Error("an unknown method is repeated")
	}
	t.Logf("%d methods compared", len(want))
}
