// Package velero holds the tests in which Velero's own code (v1.18.1: its plugin
// discovery and manager, its controllers, its install) meets opmon's stand-in plugin and
// the agent. Velero's go.mod replaces kopia with Velero's fork; a module importing Velero
// must repeat that replace, as go.mod here does.
package velero
