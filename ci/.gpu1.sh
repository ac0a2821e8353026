#!/usr/bin/env bash
set -uo pipefail
export MOE_KERNELS_ARCHS=90a MOE_KERNELS_CATALOG=minimal CMAKE_BUILD_PARALLEL_LEVEL=16
python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl
want="power.draw power.draw.instant power.draw.average enforced.power.limit power.limit clocks.sm clocks.current.sm clocks_event_reasons.sw_power_cap clocks_event_reasons.hw_slowdown clocks_event_reasons.hw_power_brake_slowdown clocks_event_reasons.sw_thermal_slowdown clocks_event_reasons.hw_thermal_slowdown clocks_event_reasons.sync_boost clocks_event_reasons.applications_clocks_setting"
have=$(nvidia-smi --help-query-gpu | grep -o '^"[^"]*"' | tr -d '"')
fields=$(for f in $want; do echo "$have" | grep -qx "$f" && echo -n "$f,"; done | sed 's/,$//')
echo "fields: $fields"
python3 -m pip install --no-build-isolation --no-deps . > $OUT/build.log 2>&1 || { tail -5 $OUT/build.log; exit 1; }
for t in 4096 16384; do
  n=2500; [ $t = 16384 ] && n=700
  nvidia-smi --query-gpu=$fields --format=csv -lms 200 > $OUT/smi-$t.csv &
  pid=$!
  (cd /tmp && python3 -m moe_kernels profile --preset deepseek-v3 --quant fp8_block --tokens $t --forwards $n) 2>&1 | tail -1
  kill $pid
done
rm -f $OUT/build.log
