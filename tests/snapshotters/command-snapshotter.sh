#!/bin/sh
# A command snapshotter for the end-to-end tests, driven by the agent as
#   command-snapshotter.sh JOURNAL GATES progress|cancel -- OPERATION_ID
# with OPMON_PLUGIN, OPMON_OWNER_KIND, OPMON_OWNER_NAME and OPMON_OWNER_UID set.
# Operation IDs: done-* complete; gate-* complete once GATES/<id> exists;
# broken-* exit non-zero with a message on stderr; garbage-* print non-JSON;
# busy-* exit 75 (a transient failure) until GATES/<id> exists, then complete.
set -eu
journal=$1 gates=$2 verb=$3
[ "$4" = "--" ] || { echo "expected -- before the operation ID, got $4" >&2; exit 2; }
id=$5
echo "$verb $id $OPMON_OWNER_KIND/$OPMON_OWNER_NAME $OPMON_OWNER_UID $OPMON_PLUGIN" >>"$journal"
case "$verb" in
cancel) exit 0 ;;
progress) ;;
*) echo "unknown verb $verb" >&2; exit 2 ;;
esac
case "$id" in
done-*) echo '{"completed":true,"nCompleted":7,"nTotal":7,"operationUnits":"file"}' ;;
gate-*)
    if [ -e "$gates/$id" ]; then
        echo '{"completed":true,"nCompleted":7,"nTotal":7,"operationUnits":"file"}'
    else
        echo '{"completed":false,"nCompleted":2,"nTotal":7,"operationUnits":"file","started":"2026-01-01T00:00:00Z"}'
    fi ;;
broken-*)
    echo "reading the volume" >&2
    echo "volume $id is gone" >&2
    exit 3 ;;
garbage-*) echo "this is not json" ;;
busy-*)
    if [ -e "$gates/$id" ]; then
        echo '{"completed":true,"nCompleted":7,"nTotal":7,"operationUnits":"file"}'
    else
        echo "backend busy" >&2
        exit 75
    fi ;;
*) echo "unknown operation $id" >&2; exit 1 ;;
esac
