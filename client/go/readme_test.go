package opmon_test

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// Every Go snippet of README.md is the body of a function of example_test.go, which
// the compiler checks: the README cannot show code that does not build.
func TestTheReadmesSnippetsAreCompiledExamples(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	examples, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	flat := func(s string) string {
		var lines []string
		for _, line := range strings.Split(s, "\n") {
			if line = strings.TrimSpace(line); line != "" {
				lines = append(lines, line)
			}
		}
		return strings.Join(lines, "\n")
	}
	compiled := flat(string(examples))
	snippets := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(readme), -1)
	if len(snippets) == 0 {
		t.Fatal("README.md has no Go snippet")
	}
	for _, s := range snippets {
		if !strings.Contains(compiled, flat(s[1])) {
			t.Errorf("this README snippet is not in example_test.go:\n%s", s[1])
		}
	}
}
