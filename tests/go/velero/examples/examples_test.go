// Package examples renders the Kubernetes examples (container/kubernetes) over the
// Velero Deployment that Velero's own install code makes, as `velero install --plugins
// velero/velero-plugin-for-aws:…` makes it, and checks what they change, what they add,
// and what Velero's repository maintenance Jobs copy of it.
//
// Needs kubectl (its kustomize); the test fails without it.
package examples_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/sirupsen/logrus"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	ctrlclient "sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	velerov1 "github.com/vmware-tanzu/velero/pkg/apis/velero/v1"
	"github.com/vmware-tanzu/velero/pkg/install"
	"github.com/vmware-tanzu/velero/pkg/repository/maintenance"
	velerotest "github.com/vmware-tanzu/velero/pkg/test"
	"github.com/vmware-tanzu/velero/pkg/uploader"
	kubeutil "github.com/vmware-tanzu/velero/pkg/util/kube"
	"github.com/vmware-tanzu/velero/pkg/util/logging"
)

// The plugin the examples stand in for, as `velero install` names it: the init container
// (after the image) and the binary its image copies to /target.
const (
	pluginImage     = "velero/velero-plugin-for-aws:v1.13.0"
	pluginContainer = "velero-velero-plugin-for-aws"
	pluginFile      = "velero-plugin-for-aws"
	agentImage      = "registry.example.com/opmon:"
)

func repoRoot(t *testing.T) string {
	root, err := filepath.Abs("../../../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// veleroInstall is the Deployment Velero's install code (pkg/install) makes for
//
//	velero install --provider aws --plugins velero/velero-plugin-for-aws:v1.13.0 \
//	    --bucket backups --secret-file ./credentials-velero --use-node-agent \
//	    --backup-location-config region=us-east-1 --snapshot-location-config region=us-east-1
//
// with the options that command's flags and defaults give (pkg/cmd/cli/install,
// AsVeleroOptions; its package itself needs a module the proxy here does not have).
func veleroInstall(t *testing.T) *appsv1.Deployment {
	resources, err := kubeutil.ParseCPUAndMemoryResources(install.DefaultVeleroPodCPURequest,
		install.DefaultVeleroPodMemRequest, install.DefaultVeleroPodCPULimit, install.DefaultVeleroPodMemLimit)
	if err != nil {
		t.Fatal(err)
	}
	nodeAgent, err := kubeutil.ParseCPUAndMemoryResources(install.DefaultNodeAgentPodCPURequest,
		install.DefaultNodeAgentPodMemRequest, install.DefaultNodeAgentPodCPULimit, install.DefaultNodeAgentPodMemLimit)
	if err != nil {
		t.Fatal(err)
	}
	options := &install.VeleroOptions{
		Namespace:             velerov1.DefaultNamespace,
		Image:                 "velero/velero:v1.18.1", // the v1.18.1 CLI's default
		ProviderName:          "aws",
		Bucket:                "backups",
		PodAnnotations:        map[string]string{},
		PodLabels:             map[string]string{},
		VeleroPodResources:    resources,
		NodeAgentPodResources: nodeAgent,
		SecretData:            []byte("[default]\naws_access_key_id=AKIDEXAMPLE\n"),
		UseNodeAgent:          true,
		UseVolumeSnapshots:    true,
		BSLConfig:             map[string]string{"region": "us-east-1"},
		VSLConfig:             map[string]string{"region": "us-east-1"},
		Plugins:               []string{pluginImage},
		Features:              []string{""},
		UploaderType:          uploader.KopiaType,
		KubeletRootDir:        install.DefaultKubeletRootDir,
	}
	for _, item := range install.AllResources(options).Items {
		if item.GetKind() != "Deployment" {
			continue
		}
		var d appsv1.Deployment
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(item.Object, &d); err != nil {
			t.Fatal(err)
		}
		return &d
	}
	t.Fatal("Velero's install makes no Deployment")
	return nil
}

// rendered is what one example renders to over velero.yaml.
type rendered struct {
	velero    *appsv1.Deployment
	daemonSet *appsv1.DaemonSet
	configs   []corev1.ConfigMap
}

func render(t *testing.T, example string, velero []byte) rendered {
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Fatalf("kubectl (Debian's kubernetes-client) renders the examples: %v", err)
	}
	tree := t.TempDir()
	if out, err := exec.Command("cp", "-r", filepath.Join(repoRoot(t), "container", "kubernetes"), tree).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v %s", err, out)
	}
	dir := filepath.Join(tree, "kubernetes", example)
	if err := os.WriteFile(filepath.Join(dir, "velero.yaml"), velero, 0o644); err != nil {
		t.Fatal(err)
	}
	env := "REPLICA_BUCKET=b\nREPLICA_ENDPOINT=https://s3.example\nLITESTREAM_ACCESS_KEY_ID=a\nLITESTREAM_SECRET_ACCESS_KEY=s\n"
	if err := os.WriteFile(filepath.Join(dir, "replica.env"), []byte(env), 0o600); err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(kubectl, "kustomize", dir)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kubectl kustomize %s over velero install's Deployment: %v\n%s", example, err, stderr.String())
	}
	var r rendered
	decoder := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096)
	for {
		var raw runtime.RawExtension
		if err := decoder.Decode(&raw); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal(raw.Raw, &meta); err != nil {
			t.Fatal(err)
		}
		var into any
		switch meta.Kind {
		case "Deployment":
			r.velero = &appsv1.Deployment{}
			into = r.velero
		case "DaemonSet":
			r.daemonSet = &appsv1.DaemonSet{}
			into = r.daemonSet
		case "ConfigMap":
			r.configs = append(r.configs, corev1.ConfigMap{})
			into = &r.configs[len(r.configs)-1]
		default:
			continue
		}
		if err := yaml.UnmarshalStrict(raw.Raw, into); err != nil {
			t.Fatalf("%s: %s: %v", example, meta.Kind, err)
		}
	}
	if r.velero == nil {
		t.Fatalf("%s renders no Deployment", example)
	}
	return r
}

func findContainer(list []corev1.Container, name string) (int, *corev1.Container) {
	for i := range list {
		if list[i].Name == name {
			return i, &list[i]
		}
	}
	return -1, nil
}

func mountAt(c *corev1.Container, path string) *corev1.VolumeMount {
	for i := range c.VolumeMounts {
		if c.VolumeMounts[i].MountPath == path {
			return &c.VolumeMounts[i]
		}
	}
	return nil
}

func envOf(c *corev1.Container, name string) *corev1.EnvVar {
	for i := range c.Env {
		if c.Env[i].Name == name {
			return &c.Env[i]
		}
	}
	return nil
}

func volumeOf(spec *corev1.PodSpec, name string) *corev1.Volume {
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}

// isOpmon is a container the examples add (the agent, its installer, Litestream).
func isOpmon(c *corev1.Container) bool {
	return strings.HasPrefix(c.Image, agentImage) || strings.HasPrefix(c.Image, "litestream/")
}

func isInstaller(c *corev1.Container) bool {
	return len(c.Command) > 0 && c.Command[0] == "/usr/local/bin/opmon-velero-plugin"
}

// checkSecurity: every container the examples add runs without privilege.
func checkSecurity(t *testing.T, example string, c *corev1.Container) {
	s := c.SecurityContext
	if s == nil || s.RunAsNonRoot == nil || !*s.RunAsNonRoot || s.ReadOnlyRootFilesystem == nil ||
		!*s.ReadOnlyRootFilesystem || s.AllowPrivilegeEscalation == nil || *s.AllowPrivilegeEscalation ||
		s.Capabilities == nil || !slices.Equal(s.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("%s: %s runs with %+v", example, c.Name, s)
	}
}

// The documented velero_plugin table's path in the agent's agent.toml.
func documentedPluginPath(t *testing.T, example string, configs []corev1.ConfigMap) string {
	for _, cm := range configs {
		for _, line := range strings.Split(cm.Data["agent.toml"], "\n") {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "# velero_plugin = "); ok {
				return strings.Trim(rest, `"`)
			}
		}
	}
	t.Fatalf("%s: agent.toml documents no velero_plugin table", example)
	return ""
}

// Each example, applied over the Deployment Velero's install makes: Velero's own parts
// unchanged, opmon's consistent with each other and with the real install's names.
func TestTheExamplesPatchVelerosOwnInstall(t *testing.T) {
	input := veleroInstall(t)
	velero, err := yaml.Marshal(input)
	if err != nil {
		t.Fatal(err)
	}
	for _, example := range []string{"sidecar", "sidecar-litestream", "daemonset-velero"} {
		t.Run(example, func(t *testing.T) {
			r := render(t, example, velero)
			in, out := &input.Spec.Template.Spec, &r.velero.Spec.Template.Spec

			// Velero's parts. Its container stays first: the maintenance Jobs take
			// containers[0]'s image, env and mounts.
			if out.ServiceAccountName != in.ServiceAccountName {
				t.Errorf("service account %q, was %q", out.ServiceAccountName, in.ServiceAccountName)
			}
			if len(out.Containers) != len(in.Containers) || out.Containers[0].Name != "velero" {
				t.Fatalf("containers %v", out.Containers)
			}
			was, is := in.Containers[0], out.Containers[0]
			if is.Image != was.Image || !slices.Equal(is.Command, was.Command) || !slices.Equal(is.Args, was.Args) ||
				!reflect.DeepEqual(is.Ports, was.Ports) || !reflect.DeepEqual(is.Resources, was.Resources) {
				t.Errorf("Velero's container changed:\n%+v\nwas\n%+v", is, was)
			}
			// Every variable Velero had, as it was and in its order (opmon's are added).
			kept := slices.DeleteFunc(slices.Clone(is.Env), func(e corev1.EnvVar) bool {
				return !slices.ContainsFunc(was.Env, func(w corev1.EnvVar) bool { return w.Name == e.Name })
			})
			if !reflect.DeepEqual(kept, was.Env) {
				t.Errorf("Velero's env changed: %v, was %v", is.Env, was.Env)
			}
			for _, m := range was.VolumeMounts {
				if got := mountAt(&is, m.MountPath); got == nil || *got != m {
					t.Errorf("Velero's mount %v is now %v", m, got)
				}
			}
			for _, v := range in.Volumes {
				if got := volumeOf(out, v.Name); got == nil || !reflect.DeepEqual(*got, v) {
					t.Errorf("Velero's volume %v is now %v", v, got)
				}
			}
			last := -1
			for _, c := range in.InitContainers {
				at, got := findContainer(out.InitContainers, c.Name)
				if got == nil || !reflect.DeepEqual(*got, c) || at < last {
					t.Errorf("Velero's init container %s: %+v at %d", c.Name, got, at)
				}
				last = at
			}

			// The installer: after every plugin's copy, standing in for the binary
			// the plugin's image copies, with both volumes.
			installerAt := slices.IndexFunc(out.InitContainers, func(c corev1.Container) bool { return isInstaller(&c) })
			if installerAt < 0 {
				t.Fatal("no opmon-velero-plugin installer")
			}
			installer := &out.InitContainers[installerAt]
			want := []string{"/usr/local/bin/opmon-velero-plugin", "install", "/target/" + pluginFile}
			if !slices.Equal(installer.Command, want) {
				t.Errorf("installer %v, want %v", installer.Command, want)
			}
			if at, c := findContainer(out.InitContainers, pluginContainer); c == nil || c.Image != pluginImage || at > installerAt {
				t.Errorf("the plugin's own init container %s (%v) at %d, the installer at %d", pluginContainer, c, at, installerAt)
			}
			for _, c := range out.InitContainers[installerAt+1:] {
				if m := mountAt(&c, "/target"); m != nil && m.Name == "plugins" {
					t.Errorf("%s copies a plugin after the installer", c.Name)
				}
			}
			if len(installer.Env) > 0 {
				t.Errorf("the installer gets an environment: %v", installer.Env)
			}
			for path, name := range map[string]string{"/target": "plugins", "/opmon/plugins": "opmon-plugins"} {
				if m := mountAt(installer, path); m == nil || m.Name != name {
					t.Errorf("installer's %s: %v", path, m)
				}
			}
			if m := mountAt(&is, "/opmon/plugins"); m == nil || m.Name != "opmon-plugins" || !m.ReadOnly {
				t.Errorf("Velero's /opmon/plugins: %v", m)
			}
			if m := mountAt(&is, "/plugins"); m == nil || m.Name != "plugins" {
				t.Errorf("Velero reads its plugins from %v", m)
			}
			if v := volumeOf(out, "opmon-plugins"); v == nil || v.EmptyDir == nil {
				t.Errorf("opmon-plugins: %v", v)
			}
			for i := range out.InitContainers {
				if c := &out.InitContainers[i]; isOpmon(c) {
					checkSecurity(t, example, c)
				}
			}

			// The socket: where Velero's stand-in looks is where the agent serves.
			socket := envOf(&is, "OPMON_SOCKET")
			if socket == nil || socket.Value != "/run/opmon/agent.sock" {
				t.Fatalf("Velero's OPMON_SOCKET: %v", socket)
			}
			table := documentedPluginPath(t, example, r.configs)
			if example == "daemonset-velero" {
				checkDaemonSet(t, r, table)
				return
			}
			agentAt := slices.IndexFunc(out.InitContainers, func(c corev1.Container) bool {
				return strings.HasPrefix(c.Image, agentImage) && !isInstaller(&c)
			})
			if agentAt < installerAt {
				t.Fatalf("the agent (at %d) starts before the installer (at %d)", agentAt, installerAt)
			}
			agent := &out.InitContainers[agentAt]
			if agent.RestartPolicy == nil || *agent.RestartPolicy != corev1.ContainerRestartPolicyAlways {
				t.Errorf("the agent is not a native sidecar")
			}
			// What Velero's plugins see, the agent's copy sees: Velero's env, mounts.
			if !reflect.DeepEqual(agent.Env, is.Env) {
				t.Errorf("the agent's env %v, Velero's %v", agent.Env, is.Env)
			}
			for _, path := range []string{"/run/opmon", "/var/lib/opmon-storage", "/opmon/plugins", "/plugins", "/credentials", "/scratch"} {
				a, v := mountAt(agent, path), mountAt(&is, path)
				if a == nil || v == nil || a.Name != v.Name {
					t.Errorf("%s: the agent mounts %v, Velero %v", path, a, v)
				}
			}
			if table != "/opmon/plugins/"+pluginFile {
				t.Errorf("agent.toml's velero_plugin %s, the installer puts it at /opmon/plugins/%s", table, pluginFile)
			}
			checkMaintenanceJob(t, r.velero)
		})
	}
}

func checkDaemonSet(t *testing.T, r rendered, table string) {
	if r.daemonSet == nil {
		t.Fatal("no DaemonSet")
	}
	spec := &r.daemonSet.Spec.Template.Spec
	_, copier := findContainer(spec.InitContainers, pluginContainer)
	if copier == nil || copier.Image != pluginImage {
		t.Fatalf("the agent's copy of the plugin comes from %v, Velero's from %s", copier, pluginImage)
	}
	_, agent := findContainer(spec.Containers, "opmon")
	if agent == nil || mountAt(agent, "/plugins") == nil || mountAt(copier, "/target").Name != mountAt(agent, "/plugins").Name {
		t.Errorf("the agent does not mount the copy at /plugins")
	}
	if table != "/plugins/"+pluginFile {
		t.Errorf("agent.toml's velero_plugin %s, the copy is /plugins/%s", table, pluginFile)
	}
	for i := range spec.Containers {
		checkSecurity(t, "daemonset-velero", &spec.Containers[i])
	}
	checkMaintenanceJob(t, r.velero)
}

// checkMaintenanceJob has Velero's repository maintenance build its Job from the
// rendered Deployment (it copies every volume, and the first container's env and
// mounts): the Job must be able to run on any node, so it mounts no claim of opmon's
// (the kubelet mounts only the volumes a container uses), and every volume it mounts is
// one each node can give it.
func checkMaintenanceJob(t *testing.T, deployment *appsv1.Deployment) {
	deployment = deployment.DeepCopy()
	bsl := &velerov1.BackupStorageLocation{ObjectMeta: metav1.ObjectMeta{Namespace: "velero", Name: "default"}}
	repo := &velerov1.BackupRepository{
		ObjectMeta: metav1.ObjectMeta{Namespace: "velero", Name: "app-default-kopia"},
		Spec: velerov1.BackupRepositorySpec{
			VolumeNamespace: "app", BackupStorageLocation: "default", RepositoryType: "kopia",
		},
	}
	cli := velerotest.NewFakeControllerRuntimeClient(t, deployment, bsl, repo)
	logger := logrus.New()
	logger.Out = io.Discard
	name, err := maintenance.StartNewJob(cli, context.Background(), repo, "", logrus.InfoLevel,
		logging.NewFormatFlag(), logger)
	if err != nil {
		t.Fatalf("Velero's maintenance job: %v", err)
	}
	job := &batchv1.Job{}
	if err := cli.Get(context.Background(), ctrlclient.ObjectKey{Namespace: "velero", Name: name}, job); err != nil {
		t.Fatal(err)
	}
	spec := &job.Spec.Template.Spec
	if len(spec.Containers) != 1 || spec.Containers[0].Image != deployment.Spec.Template.Spec.Containers[0].Image {
		t.Fatalf("the Job runs %v", spec.Containers)
	}
	if len(spec.Volumes) != len(deployment.Spec.Template.Spec.Volumes) {
		t.Errorf("the Job copies %d of %d volumes", len(spec.Volumes), len(deployment.Spec.Template.Spec.Volumes))
	}
	for _, m := range spec.Containers[0].VolumeMounts {
		v := volumeOf(spec, m.Name)
		switch {
		case v == nil:
			t.Errorf("the Job mounts %s, which it does not have", m.Name)
		case v.PersistentVolumeClaim != nil:
			t.Errorf("the Job mounts claim %s: on another node than Velero's it cannot", v.PersistentVolumeClaim.ClaimName)
		case v.HostPath != nil && (v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathDirectory):
			t.Errorf("the Job mounts host path %s, which may be missing or made by it", v.HostPath.Path)
		}
	}
}

// The Rust tests render the examples over tests/kubernetes/velero.yaml: it must be the
// Deployment Velero's install makes (OPMON_WRITE_VELERO_YAML=1 writes it so).
func TestTheRustTestsInputIsVelerosInstall(t *testing.T) {
	made, err := yaml.Marshal(veleroInstall(t))
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(repoRoot(t), "tests", "kubernetes", "velero.yaml")
	header := "# The Deployment Velero v1.18.1's install code makes for `velero install --provider aws\n" +
		"# --plugins velero/velero-plugin-for-aws:v1.13.0 --use-node-agent ...`, written by\n" +
		"# tests/go/velero/examples (OPMON_WRITE_VELERO_YAML=1): the tests' stand-in for a user's\n" +
		"# Velero Deployment, which the overlays in container/kubernetes patch. Not an example.\n"
	if os.Getenv("OPMON_WRITE_VELERO_YAML") == "1" {
		if err := os.WriteFile(path, append([]byte(header), made...), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	text, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(text) != header+string(made) {
		t.Fatalf("%s is not what Velero's install makes (OPMON_WRITE_VELERO_YAML=1 go test ./examples writes it)", path)
	}
}

// The installer and tables docs/velero-with-opmon.md prints ("Installing") are the ones
// the examples render over Velero's install.
func TestTheDocumentedInstallStepsAreTheExamples(t *testing.T) {
	text, err := os.ReadFile(filepath.Join(repoRoot(t), "docs", "velero-with-opmon.md"))
	if err != nil {
		t.Fatal(err)
	}
	installing := string(text[bytes.Index(text, []byte("## Installing")):])
	block := func(lang string) string {
		_, rest, ok := strings.Cut(installing, "```"+lang+"\n")
		body, _, closed := strings.Cut(rest, "```")
		if !ok || !closed {
			t.Fatalf("no %s block under Installing", lang)
		}
		return body
	}
	var printed []corev1.Container
	if err := yaml.UnmarshalStrict([]byte(block("yaml")), &printed); err != nil || len(printed) != 1 {
		t.Fatalf("the printed installer: %v", err)
	}
	velero, err := yaml.Marshal(veleroInstall(t))
	if err != nil {
		t.Fatal(err)
	}
	toml := block("toml")
	for _, example := range []string{"sidecar", "daemonset-velero"} {
		r := render(t, example, velero)
		spec := &r.velero.Spec.Template.Spec
		at := slices.IndexFunc(spec.InitContainers, func(c corev1.Container) bool { return isInstaller(&c) })
		installer := spec.InitContainers[at]
		if installer.Name != printed[0].Name || installer.Image != printed[0].Image ||
			!slices.Equal(installer.Command, printed[0].Command) ||
			!reflect.DeepEqual(installer.VolumeMounts, printed[0].VolumeMounts) {
			t.Errorf("%s installs with %+v; the docs print %+v", example, installer, printed[0])
		}
		path := documentedPluginPath(t, example, r.configs)
		if !strings.Contains(toml, fmt.Sprintf("velero_plugin = %q", path)) {
			t.Errorf("%s's agent.toml documents velero_plugin %s; the docs print:\n%s", example, path, toml)
		}
	}
}
