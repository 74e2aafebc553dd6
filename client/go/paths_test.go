package opmon_test

import (
	"os"
	"os/exec"
	"regexp"
	"testing"

	opmon "opmon/client"
	"opmon/client/internal/agenttest"
)

// DefaultSocketPath is where the real agent listens by default, in each environment
// (the agent's --print-config says where that is).
func TestTheDefaultSocketIsTheAgents(t *testing.T) {
	bin := agenttest.AgentBinary(t)
	line := regexp.MustCompile(`(?m)^socket = "([^"]*)"`)
	cases := []map[string]string{
		{"OPMON_SOCKET": "/srv/opmon/api.sock"},
		{"RUNTIME_DIRECTORY": "/run/opmon-a:/run/opmon-b"},
		{"XDG_RUNTIME_DIR": "/run/user/1000"},
		{},
	}
	for _, env := range cases {
		for _, name := range []string{"OPMON_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"} {
			t.Setenv(name, env[name])
			if env[name] == "" {
				os.Unsetenv(name)
			}
		}
		cmd := exec.Command(bin, "--print-config")
		cmd.Env = []string{"OPMON_CONFIG=/dev/null", "PATH=" + os.Getenv("PATH")}
		for name, value := range env {
			cmd.Env = append(cmd.Env, name+"="+value)
		}
		out, err := cmd.CombinedOutput()
		m := line.FindSubmatch(out)
		if err != nil || m == nil {
			t.Fatalf("%s --print-config: %v\n%s", bin, err, out)
		}
		if got := opmon.DefaultSocketPath(); got != string(m[1]) {
			t.Errorf("with %v: DefaultSocketPath() = %s, the agent's is %s", env, got, m[1])
		}
	}
}
