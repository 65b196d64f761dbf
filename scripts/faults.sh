#!/usr/bin/env bash
# The fault and bad-input tests, run N times (default 3), and their table in
# docs/security.md ("Faults tried") written again from what happened:
#   bash scripts/faults.sh [N]
# Needs cargo-nextest. Runs as any user; the disk test needs root and says when it skips.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
filter='test(/^hostile::|^disk::|fuzz_inputs|^bad_input::|^view::tests|^lease::tests|^clock::tests|^service::challenge::tests|^service::gossip::tests|^service::directed::tests|^service::tests|custom_code_needs|a_worker_that_signs_two_bids|an_acceptance_of_an_award_never_sent|identify_says_what_the_spec_says|the_specs_examples|offers_carry_the_networks_fee_terms|a_change_to_a_job_writes_only|a_job_kept_whole_loads|a_job_is_its_parts|own_control_messages_fit|past_the_offer_rate|two_acceptances_of_one_epoch|an_offer_held_costs_about|a_burst_is_forgiven/)'

out=$(mktemp)
trap 'rm -f "$out"' EXIT
for i in $(seq 1 "$runs"); do
    echo "==> run $i of $runs" >&2
    cargo nextest run --workspace --locked --no-fail-fast --status-level all \
        --final-status-level none -E "$filter" 2>&1 | tee -a "$out" >&2 || true
done

table=$(mktemp)
{
    echo "<!-- faults:begin (written by scripts/faults.sh; do not edit by hand) -->"
    echo "Last run: $(date -u +%Y-%m-%d), $(nproc) cores, \`bash scripts/faults.sh $runs\`."
    echo
    echo "| test | runs | passed | slowest |"
    echo "|---|---|---|---|"
    awk -v runs="$runs" '
        /^ *(PASS|FAIL|SIGSEGV|SIGABRT|TIMEOUT) / {
            status = $1
            t = $0; sub(/^[^[]*\[ */, "", t); sub(/s\].*/, "", t)
            name = $(NF - 1) " " $NF
            n[name]++
            if (status == "PASS") ok[name]++
            if (t + 0 > slow[name] + 0) slow[name] = t
        }
        END {
            for (name in n) printf "| `%s` | %d | %d | %.1f s |\n", name, n[name], ok[name], slow[name]
        }' "$out" | sort
    echo "<!-- faults:end -->"
} > "$table"

awk -v table="$table" '
    /<!-- faults:begin/ { while ((getline line < table) > 0) print line; skip = 1; next }
    /<!-- faults:end -->/ { skip = 0; next }
    !skip { print }
' docs/security.md > docs/security.md.new
mv docs/security.md.new docs/security.md
failed=$(awk -F'|' 'NR > 4 && $3 != $4 { print }' "$table" | grep -c '`' || true)
echo "faults: $(grep -c '^| `' "$table") tests, $failed with a failure; table written to docs/security.md" >&2
[ "$failed" = 0 ]
