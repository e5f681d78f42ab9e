cd /work/main
export HF_HUB_OFFLINE=1
PY=.venv/bin/python
echo "== two at once, same port 8997, hp=$1"
$PY -m rawserve --model /tmp/s41e/gpt2 --device cpu --port 8997 --http-processes $1 > /tmp/s41e/logs/pa$1.log 2>&1 & A=$!
$PY -m rawserve --model /tmp/s41e/gpt2 --device cpu --port 8997 --http-processes $1 > /tmp/s41e/logs/pb$1.log 2>&1 & B=$!
sleep 25
for p in $A $B; do if kill -0 $p 2>/dev/null; then echo "$p alive"; else wait $p; echo "$p exited rc=$?"; fi; done
grep -h -E "ERROR|listening|ready in" /tmp/s41e/logs/pa$1.log /tmp/s41e/logs/pb$1.log | cut -c1-200
ss -ltnp 2>/dev/null | grep 8997 | cut -c1-150
echo "== third start on the taken port"
S=$(date +%s.%N); $PY -m rawserve --model /tmp/s41e/gpt2 --device cpu --port 8997 --http-processes $1 > /tmp/s41e/logs/pc$1.log 2>&1; echo "rc=$? after $(echo "$(date +%s.%N) - $S" | bc) s"; cat /tmp/s41e/logs/pc$1.log | cut -c1-200
for p in $A $B; do kill -TERM $p 2>/dev/null; done; sleep 3; ps -eo pid,ppid,cmd | grep "port 8997" | grep -v grep
