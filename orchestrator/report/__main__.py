from orchestrator.report.build import main

main()
