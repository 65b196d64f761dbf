# Works for a while, then writes its output: long enough to be killed mid-run.
sleep "${1:-8}"
echo "slept ${1:-8} s on attempt $CANNABIS_ATTEMPT" > "$CANNABIS_WORK/out.txt"
