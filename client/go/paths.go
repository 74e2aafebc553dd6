package opmon

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// DefaultSocketPath is where the agent listens when nobody says otherwise, resolved as
// the agent and the opmon CLI resolve it: $OPMON_SOCKET (the CLI's variable) if set,
// else $RUNTIME_DIRECTORY/agent.sock (systemd; the first of its directories), else
// /run/opmon/agent.sock as root, else $XDG_RUNTIME_DIR/opmon/agent.sock, else
// /tmp/opmon-<uid>/agent.sock.
func DefaultSocketPath() string {
	if s := os.Getenv("OPMON_SOCKET"); s != "" {
		return s
	}
	if dir := firstPathOf("RUNTIME_DIRECTORY"); dir != "" {
		return filepath.Join(dir, "agent.sock")
	}
	uid := os.Geteuid()
	if uid == 0 {
		return "/run/opmon/agent.sock"
	}
	if dir := firstPathOf("XDG_RUNTIME_DIR"); dir != "" {
		return filepath.Join(dir, "opmon", "agent.sock")
	}
	return fmt.Sprintf("/tmp/opmon-%d/agent.sock", uid)
}

// firstPathOf is the first entry of the colon-separated list in the variable.
func firstPathOf(variable string) string {
	first, _, _ := strings.Cut(os.Getenv(variable), ":")
	return first
}
